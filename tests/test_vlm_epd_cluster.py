"""Encoder nodes (E/P/D) with `pdserve up --encode-nodes 1`: a tiny random Qwen2.5-VL through the
store, the encoder node encoding and the prefill node loading the embeddings (and a lost encoder
node costing nothing), then Gemma 3 (image tokens attend both ways) with its KV over NIXL and its
embeddings through a Redis. Greedy output equals the offline engine's (itself exact against
transformers: test_qwen2_5_vl_engine.py, test_gemma3_vl_engine.py). Each cluster runs alone,
with 256 KV blocks a node: several clusters at once are memory CI lacks.
"""
from __future__ import annotations

import os
import signal

import httpx
import pytest

openai = pytest.importorskip("openai")
Image = pytest.importorskip("PIL.Image")

from pdserve.offline.llm import LLM  # noqa: E402
from pdserve.testing.redis_server import redis_server  # noqa: E402
from pdserve.testing.up_cluster import node_pids, node_stats, running_cluster, wait_for  # noqa: E402
from pdserve.testing.vlm_chat import CASES, chat, offline, random_pictures  # noqa: E402
from pdserve.testing.vlm_checkpoints import make_gemma3_vl, make_qwen2_5_vl  # noqa: E402

SMALL_KV = ("--num-kv-blocks", "256")


@pytest.fixture(scope="module")
def pictures():
    return random_pictures()


def _stat(url: str, role: str, name: str) -> int:
    return sum(s.get(name, 0) for s in node_stats(url).values() if s["role"] == role and s["healthy"])


def test_gemma3_chat_with_images_equals_offline(tmp_path_factory, pictures):
    """Gemma 3, 16 tokens a prefill step (the prefill node never cuts an image across chunks),
    E/P/D with its KV over NIXL and the embeddings through a Redis."""
    path = make_gemma3_vl(tmp_path_factory.mktemp("gemma3_cluster"))
    gemma = LLM(str(path), block_size=16, num_kv_blocks=256)
    common = ("--model", str(path), "--served-model-name", "vlm", "--prefill-nodes", "1", "--decode-nodes", "1",
              "--max-num-batched-tokens", "16", *SMALL_KV)
    with redis_server() as (redis_url, _), running_cluster(
            *common, "--kv-transfer", "nixl", "--store", redis_url, "--encode-nodes", "1") as (url, _):
        for before, which, after in CASES:
            images = [pictures[i] for i in which]
            ids, usage = chat(url, before, images, after)
            want, prompt_tokens = offline(gemma, before, images, after, 8)
            assert ids == want and usage.prompt_tokens == prompt_tokens, before
        wait_for(lambda: _stat(url, "encode", "encoder_runs") == 2, timeout_s=10)
        assert _stat(url, "prefill", "encoder_runs") == 0


def test_encoder_node_encodes_and_a_lost_one_costs_nothing(tmp_path_factory, pictures):
    """E/P/D: the encoder node encodes, the prefill node loads the embeddings from the store and
    encodes nothing; the same picture behind other text is an encoder-cache hit there; with the
    encoder node killed, the prefill node encodes by itself, with the same output."""
    checkpoint = make_qwen2_5_vl(tmp_path_factory.mktemp("vlm_epd"))
    llm = LLM(str(checkpoint), block_size=16, num_kv_blocks=256)
    with running_cluster("--model", str(checkpoint), "--served-model-name", "vlm", "--encode-nodes", "1",
                         "--prefill-nodes", "1", "--decode-nodes", "1", "--kv-transfer", "store", *SMALL_KV) as (url, proc):
        for before, which, after in CASES:
            images = [pictures[i] for i in which]
            assert chat(url, before, images, after)[0] == offline(llm, before, images, after, 8)[0]
        # picture 0 loaded once: the prefill node keeps it in its own encoder cache for the second prompt
        wait_for(lambda: _stat(url, "prefill", "embeddings_loaded") >= 2, timeout_s=10)
        assert _stat(url, "encode", "encoder_runs") == 2 and _stat(url, "prefill", "encoder_runs") == 0
        assert chat(url, "Again: ", [pictures[1]], "?")[0] == offline(llm, "Again: ", [pictures[1]], "?", 8)[0]
        wait_for(lambda: _stat(url, "encode", "encoder_cache_hits") >= 2, timeout_s=10)
        os.kill(node_pids(proc.pid)["encode-0"], signal.SIGKILL)
        assert chat(url, "Lost: ", [pictures[2]], "?")[0] == offline(llm, "Lost: ", [pictures[2]], "?", 8)[0]
        wait_for(lambda: _stat(url, "prefill", "encoder_runs") >= 1, timeout_s=10)
        assert httpx.get(f"{url}/health", timeout=5).json()["failover"]["encodes_remote"] == 3
