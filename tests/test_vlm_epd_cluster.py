"""Encoder nodes (E/P/D) with `pdserve up --encode-nodes 1`: Gemma 3 (image tokens attend both
ways) with its KV and its embeddings over NIXL and no Redis, a decode node and then the encoder
node killed; Gemma 3 with its KV and embeddings through the store (another picture never a prefix
hit, the same one a hit with no second encoder run, a decode node killed); a tiny random Qwen2.5-VL through the store and over NIXL, the encoder node
encoding and the prefill node taking the embeddings (and a lost encoder node costing nothing).
Greedy output equals transformers' generate, or the offline engine's (itself exact against
transformers: test_qwen2_5_vl_engine.py, test_gemma3_vl_engine.py). Each cluster runs alone,
with 256 KV blocks a node: several clusters at once are memory CI lacks.
"""
from __future__ import annotations

import json
import os
import signal

import httpx
import pytest

openai = pytest.importorskip("openai")
Image = pytest.importorskip("PIL.Image")

from pdserve.offline.llm import LLM  # noqa: E402
from pdserve.testing.up_cluster import KILL_PACE, DecodeNodeKiller, node_pids, node_stats, running_cluster, wait_for  # noqa: E402
from pdserve.testing.vlm_chat import CASES, chat, offline, offline_prompt, random_pictures, transformers_greedy  # noqa: E402
from pdserve.testing.vlm_checkpoints import load_gemma3_vl_reference, make_gemma3_vl, make_qwen2_5_vl  # noqa: E402

SMALL_KV = ("--num-kv-blocks", "256")
LONG = 400  # with KILL_PACE, a stream long enough that a kill after token 20 lands mid-stream


@pytest.fixture(scope="module")
def pictures():
    return random_pictures()


def _stat(url: str, role: str, name: str) -> int:
    return sum(s.get(name, 0) for s in node_stats(url).values() if s["role"] == role and s["healthy"])


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """One Gemma 3 checkpoint (the same seed) for both Gemma clusters, with its offline engine, its
    transformers reference and the tokenizer, built once: the second build cost 4.6 s of CPU."""
    path = make_gemma3_vl(tmp_path_factory.mktemp("gemma3_cluster"))
    llm = LLM(str(path), block_size=16, num_kv_blocks=256)
    return path, llm, load_gemma3_vl_reference(path), llm.get_tokenizer()


def test_gemma3_epd_over_nixl_equals_transformers(gemma, pictures):
    """Gemma 3 E/P/D with no Redis: KV and embeddings both over NIXL, 16 tokens a prefill step
    (the prefill node never cuts an image across chunks). Greedy tokens equal transformers'; the
    prefill node READs the embeddings and encodes nothing; a decode node killed mid-stream and
    then the encoder node killed each cost nothing."""
    path, gemma, reference, tokenizer = gemma
    with running_cluster("--model", str(path), "--served-model-name", "vlm", "--prefill-nodes", "1",
                         "--decode-nodes", "2", "--encode-nodes", "1", "--kv-transfer", "nixl",
                         "--max-num-batched-tokens", "16", *SMALL_KV, *KILL_PACE) as (url, proc):
        for before, which, after in CASES:
            images = [pictures[i] for i in which]
            ids, usage = chat(url, before, images, after)
            want = transformers_greedy(reference, tokenizer, before, images, after, 8)
            assert ids[:len(want)] == want and usage.prompt_tokens == offline(gemma, before, images, after, 1)[1]
        wait_for(lambda: _stat(url, "prefill", "embeddings_loaded") == 2, timeout_s=10)
        assert _stat(url, "encode", "encoder_runs") == 2 and _stat(url, "prefill", "encoder_runs") == 0
        assert _stat(url, "prefill", "embedding_bytes_nixl") > 0 and _stat(url, "prefill", "integrity_failures") == 0
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert 'pdserve_node_healthy{node="encode-0",role="encode"} 1.0' in metrics
        assert 'pdserve_embedding_transfer_bytes_total{node="prefill-0",path="nixl"}' in metrics
        killer = DecodeNodeKiller(url, proc.pid)
        ids, _ = chat(url, "Tell a long story about ", [pictures[2]], ".", LONG, killer)
        assert killer.killed, "the stream ended before a decode node could be killed"
        assert ids == offline(gemma, "Tell a long story about ", [pictures[2]], ".", LONG)[0]
        os.kill(node_pids(proc.pid)["encode-0"], signal.SIGKILL)
        new = random_pictures(seed=2)[:1]  # in no encoder cache yet
        want = transformers_greedy(reference, tokenizer, "Lost: ", new, "?", 8)
        assert chat(url, "Lost: ", new, "?")[0][:len(want)] == want
        wait_for(lambda: _stat(url, "prefill", "encoder_runs") >= 1, timeout_s=10)


def _runs(url: str) -> int:
    return sum(s.get("encoder_runs", 0) for s in node_stats(url).values() if s["healthy"])


def test_gemma3_epd_through_the_store_isolates_images(gemma, pictures):
    """Gemma 3 E/P/D with KV and embeddings through the store's Redis: greedy tokens equal
    transformers'; the same text with another picture shares no cached token past the text before
    it, and gets other tokens; the same picture again is a prefix hit past the image with no second
    encoder run anywhere; a decode node killed mid-stream costs nothing."""
    path, gemma, reference, tokenizer = gemma
    with running_cluster("--model", str(path), "--served-model-name", "vlm", "--prefill-nodes", "1",
                         "--decode-nodes", "2", "--encode-nodes", "1", "--kv-transfer", "store",
                         *SMALL_KV, *KILL_PACE) as (url, proc):
        for before, which, after in CASES:
            images = [pictures[i] for i in which]
            want = transformers_greedy(reference, tokenizer, before, images, after, 8)
            assert chat(url, before, images, after)[0][:len(want)] == want
        wait_for(lambda: _stat(url, "prefill", "embeddings_loaded") == 2, timeout_s=10)
        assert _stat(url, "encode", "encoder_runs") == 2 and _stat(url, "prefill", "encoder_runs") == 0
        assert _stat(url, "prefill", "embedding_bytes_store") > 0
        before, after = "Please describe this picture: ", " in detail, and nothing else."
        image_start = offline_prompt(gemma, before, [pictures[2]], after).index(gemma_image_token(path))
        first, _ = chat(url, before, [pictures[2]], after)
        other, usage_other = chat(url, before, [pictures[1]], after)
        assert usage_other.prompt_tokens_details.cached_tokens <= image_start
        assert other == offline(gemma, before, [pictures[1]], after, 8)[0] != first
        runs = wait_for(lambda: _runs(url) if _runs(url) == 3 else 0, timeout_s=10)  # pictures 0, 1 and 2, once each
        again, usage_again = chat(url, before, [pictures[2]], after)
        assert again == first and usage_again.prompt_tokens_details.cached_tokens > image_start
        wait_for(lambda: _stat(url, "decode", "prefills_handed_over") >= len(CASES) + 3, timeout_s=10)
        assert _runs(url) == runs
        killer = DecodeNodeKiller(url, proc.pid)
        ids, _ = chat(url, "Tell a long story about ", [pictures[0]], ".", LONG, killer)
        assert killer.killed, "the stream ended before a decode node could be killed"
        assert ids == offline(gemma, "Tell a long story about ", [pictures[0]], ".", LONG)[0]


def gemma_image_token(path) -> int:
    return json.loads((path / "config.json").read_text())["image_token_index"]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    checkpoint = make_qwen2_5_vl(tmp_path_factory.mktemp("vlm_epd"))
    return checkpoint, LLM(str(checkpoint), block_size=16, num_kv_blocks=256)


@pytest.mark.parametrize("transfer", ["store", "nixl"])
def test_encoder_node_encodes_and_a_lost_one_costs_nothing(qwen, pictures, transfer):
    """E/P/D: the encoder node encodes, the prefill node takes the embeddings (through the store,
    or READ over NIXL) and encodes nothing; the same picture behind other text is an
    encoder-cache hit there; with the encoder node killed, the prefill node encodes by itself,
    with the same output."""
    checkpoint, llm = qwen
    with running_cluster("--model", str(checkpoint), "--served-model-name", "vlm", "--encode-nodes", "1",
                         "--prefill-nodes", "1", "--decode-nodes", "1", "--kv-transfer", transfer, *SMALL_KV) as (url, proc):
        for before, which, after in CASES:
            images = [pictures[i] for i in which]
            assert chat(url, before, images, after)[0] == offline(llm, before, images, after, 8)[0]
        # picture 0 taken once: the prefill node keeps it in its own encoder cache for the second prompt
        wait_for(lambda: _stat(url, "prefill", "embeddings_loaded") >= 2, timeout_s=10)
        assert _stat(url, "encode", "encoder_runs") == 2 and _stat(url, "prefill", "encoder_runs") == 0
        assert _stat(url, "prefill", f"embedding_bytes_{transfer}") > 0
        assert chat(url, "Again: ", [pictures[1]], "?")[0] == offline(llm, "Again: ", [pictures[1]], "?", 8)[0]
        wait_for(lambda: _stat(url, "encode", "encoder_cache_hits") >= 2, timeout_s=10)
        os.kill(node_pids(proc.pid)["encode-0"], signal.SIGKILL)
        assert chat(url, "Lost: ", [pictures[2]], "?")[0] == offline(llm, "Lost: ", [pictures[2]], "?", 8)[0]
        wait_for(lambda: _stat(url, "prefill", "encoder_runs") >= 1, timeout_s=10)
        assert httpx.get(f"{url}/health", timeout=5).json()["failover"]["encodes_remote"] == 3
