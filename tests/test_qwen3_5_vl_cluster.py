"""Qwen3.5 with images across P/D: the official openai client sends chat requests with images to
`pdserve up` on a tiny random Qwen3_5ForConditionalGeneration, 1P1D over the store and over
NIXL. The prefill node encodes the images and hands over the attention layers' KV blocks with
the Gated DeltaNet layers' state; the decode node continues from both, with the M-RoPE delta.
The greedy output equals the offline engine's (itself exact against transformers, see
test_qwen3_5_vl_engine.py), and no state slot stays in use on any node.
"""
from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
Image = pytest.importorskip("PIL.Image")

from pdserve.offline.llm import LLM  # noqa: E402
from pdserve.testing.up_cluster import node_stats, running_clusters, wait_for  # noqa: E402
from pdserve.testing.vlm_chat import CASES, chat, offline, random_pictures  # noqa: E402
from pdserve.testing.vlm_checkpoints import make_qwen3_5_vl  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_qwen3_5_vl(tmp_path_factory.mktemp("qwen3_5_vl_cluster"))


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(str(checkpoint), block_size=16, num_kv_blocks=256)


@pytest.fixture(scope="module")
def pictures():
    return random_pictures()


@pytest.fixture(scope="module")
def clusters(checkpoint):
    # 256 blocks a node: the default half-gigabyte KV pool a node would take is memory CI lacks.
    # 32 tokens a step: prompts prefilled in chunks that cut through images, leaving a state
    # snapshot at each chunk's end (a block boundary)
    common = ("--model", str(checkpoint), "--served-model-name", "vlm", "--prefill-nodes", "1",
              "--decode-nodes", "1", "--num-kv-blocks", "256", "--max-num-seqs", "8",
              "--max-num-batched-tokens", "32")
    with running_clusters((*common, "--kv-transfer", "store"), (*common, "--kv-transfer", "nixl")) as started:
        yield {"store": started[0], "nixl": started[1]}


@pytest.mark.parametrize("transfer", ["store", "nixl"])
def test_greedy_chat_with_images_equals_offline(clusters, llm, pictures, transfer):
    url, _ = clusters[transfer]
    for before, which, after in CASES:
        images = [pictures[i] for i in which]
        ids, usage = chat(url, before, images, after)
        want, prompt_tokens = offline(llm, before, images, after, 8)
        assert ids == want, (transfer, before)
        assert usage.prompt_tokens == prompt_tokens
    # the decode node took every prompt's KV and state from the prefill node (none recomputed);
    # node stats ride on pings: wait for the next
    wait_for(lambda: sum(s.get("prefills_handed_over", 0) for s in node_stats(url).values()
                         if s["role"] == "decode") >= len(CASES), timeout_s=10)
    wait_for(lambda: all(s.get("state_slots_in_use", 0) == 0 for s in node_stats(url).values()), timeout_s=30)


def test_the_same_image_again_takes_its_prefix_and_state(clusters, llm, pictures):
    """Over the store: the second prefill takes the first prompt's blocks and the state
    snapshot at the last chunk boundary, past the image, and answers the same."""
    url, _ = clusters["store"]
    before, after = "Please describe this picture: ", " in detail, and nothing else, in many words."
    first, _ = chat(url, before, [pictures[2]], after)
    again, usage = chat(url, before, [pictures[2]], after)
    assert first == again == offline(llm, before, [pictures[2]], after, 8)[0]
    assert usage.prompt_tokens_details.cached_tokens == 64  # two 32-token chunks; the image is tokens 32-43
