"""Qwen2.5-VL at tensor-parallel size 2: rank 0 holds the vision tower and encodes; each step
sends its workers the [3, T] M-RoPE positions and the image rows with the arrays, and the rows'
embeddings as a float broadcast. Greedy output equals the one-process engine's on the same tiny
random checkpoint (itself equal to transformers' generate: test_qwen2_5_vl_engine.py), with 16
tokens a step so that chunks cut through the images, each picture encoded once; the same text
with another picture is no prefix hit, the same picture again is one. Gemma 3's text model is not
split across ranks yet, and pipeline stages do not carry images yet: both are refused at start.
"""
from __future__ import annotations

import pytest

Image = pytest.importorskip("PIL.Image")

from pdserve.offline.llm import LLM  # noqa: E402
from pdserve.testing.vlm_chat import CASES, offline, offline_output, random_pictures  # noqa: E402
from pdserve.testing.vlm_checkpoints import make_gemma3_vl, make_qwen2_5_vl  # noqa: E402

MORE_CASES = [*CASES, ("A first, ", [2, 0], "")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_qwen2_5_vl(tmp_path_factory.mktemp("vlm_tp"))


def test_tp2_greedy_equals_one_process(checkpoint):
    pictures = random_pictures()
    single = LLM(str(checkpoint), block_size=16, num_kv_blocks=128)
    want = [offline(single, before, [pictures[i] for i in which], after, 8) for before, which, after in MORE_CASES]
    tp = LLM(str(checkpoint), tensor_parallel_size=2, block_size=16, num_kv_blocks=128, max_num_batched_tokens=16)
    try:
        assert tp.engine.model.visual is not None
        for (before, which, after), expected in zip(MORE_CASES, want):
            assert offline(tp, before, [pictures[i] for i in which], after, 8) == expected, (before, which)
        assert tp.engine.encoder_stats.encoder_runs == 3  # each picture once, across chunks and prompts
        text = ("Please describe this picture: ", " in detail, and nothing else.")
        first = offline_output(tp, text[0], [pictures[2]], text[1], 8)
        other = offline_output(tp, text[0], [pictures[1]], text[1], 8)
        again = offline_output(tp, text[0], [pictures[2]], text[1], 8)
        image_start = list(first.prompt_token_ids).index(tp.engine.model.image_token_id)
        assert other.num_cached_tokens <= image_start < again.num_cached_tokens
        assert again.outputs[0].token_ids == first.outputs[0].token_ids == offline(
            single, text[0], [pictures[2]], text[1], 8)[0]
        assert tp.engine.pool.num_in_use() == 0
    finally:
        tp.close()


def test_what_is_not_split_yet_is_refused(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="pipeline_parallel_size=2: .* takes images"):
        LLM(str(checkpoint), pipeline_parallel_size=2, num_kv_blocks=64)
    gemma = make_gemma3_vl(tmp_path)
    with pytest.raises(ValueError, match="tensor_parallel_size=2: Gemma3ForConditionalGeneration"):
        LLM(str(gemma), tensor_parallel_size=2, num_kv_blocks=64)
