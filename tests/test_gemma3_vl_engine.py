"""Gemma 3 with its SigLIP tower end to end offline: pdserve's greedy output equals transformers'
generate (the processor's input_ids, pixel_values and token_type_ids, eager attention) on a
tiny random checkpoint (pdserve.testing.vlm_checkpoints.make_gemma3_vl: 4 tokens an image,
sliding window 4, so the window cuts into an image's bidirectional block).

Prompt layouts (byte tokenizer: one token a character; Gemma3Processor puts "\\n\\n<boi>",
4 image tokens, "<eoi>\\n\\n" in place of each <start_of_image>) are chosen so that images
straddle the 16-token block and chunk boundaries: chunked prefill must cut before them, and a
prefix-cache hit must stop short of them. test_the_bidirectional_mask_matters shows the
prompts are ones where the image mask changes the output.
"""
from __future__ import annotations

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

from pdserve.engine import model_runner  # noqa: E402
from pdserve.offline.llm import LLM  # noqa: E402
from pdserve.protocol.sampling_params import SamplingParams  # noqa: E402
from pdserve.testing.vlm_checkpoints import load_gemma3_vl_reference, make_gemma3_vl  # noqa: E402

BOI = "<start_of_image>"
GREEDY = SamplingParams(max_tokens=8, temperature=0)
# (text, which images). Offsets below: the image tokens' [start, end) in the expanded prompt.
ONE_IMAGE = (f"Describe {BOI} briefly.", [0])  # image at [12, 16)
TWO_IMAGES = (f"Look here: {BOI} and {BOI} then compare them", [1, 2])  # [14, 18) across 16, [28, 32)
# [12, 16) and [30, 34), across 32: 45 tokens, so a repeat's 2-block hit must stop at 16.
ACROSS_32 = (f"Describe {BOI}and then{BOI} tell me", [0, 1])
PROMPTS = [ONE_IMAGE, TWO_IMAGES, ACROSS_32, (f"{BOI}{BOI} two pictures, said the other", [2, 0])]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_gemma3_vl(tmp_path_factory.mktemp("gemma3_vl"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    return load_gemma3_vl_reference(checkpoint)


@pytest.fixture(scope="module")
def pictures():
    rng = np.random.RandomState(0)
    return [Image.fromarray(rng.randint(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in [(40, 70), (90, 30), (56, 56)]]


@pytest.fixture(scope="module")
def llm(checkpoint):
    engine = LLM(str(checkpoint), block_size=16)
    yield engine
    engine.close()


def _expected(reference, text: str, images: list) -> tuple[list[int], list[int]]:
    """(the processor's prompt ids, transformers' greedy tokens)."""
    model, processor = reference
    batch = processor(text=[text], images=[images], return_tensors="pt")
    assert "token_type_ids" in batch  # what makes transformers' image tokens bidirectional
    out = model.generate(**batch, max_new_tokens=GREEDY.max_tokens, do_sample=False)
    prompt = batch["input_ids"][0].tolist()
    return prompt, out[0, len(prompt):].tolist()


def _generate(llm: LLM, text: str, images: list):
    return llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)[0]


@pytest.mark.parametrize("prompt", PROMPTS, ids=["one", "two", "across_32", "adjacent"])
def test_greedy_output_equals_transformers(llm, reference, pictures, prompt):
    text, which = prompt
    images = [pictures[i] for i in which]
    prompt_ids, expected = _expected(reference, text, images)
    out = _generate(llm, text, images)
    assert out.prompt_token_ids == prompt_ids  # the placeholder expansion is the processor's
    assert list(out.outputs[0].token_ids) == expected


def test_chunked_prefill_never_cuts_an_image(checkpoint, reference, pictures):
    engine = LLM(str(checkpoint), block_size=16, max_num_batched_tokens=16, enable_prefix_caching=False)
    cuts = _record_chunk_ends(engine)
    try:
        for text, which in PROMPTS:
            images = [pictures[i] for i in which]
            _, expected = _expected(reference, text, images)
            assert list(_generate(engine, text, images).outputs[0].token_ids) == expected
    finally:
        engine.close()
    assert any(end % 16 for end, _ in cuts)  # some chunk was cut back from its 16 tokens
    assert not [(end, s) for end, spans in cuts for s in spans if s[0] < end < s[1]]


def _record_chunk_ends(llm: LLM) -> list[tuple[int, list[tuple[int, int]]]]:
    """Every scheduled prefill chunk's end, with its request's image spans."""
    scheduler, seen = llm.engine.scheduler, []
    schedule = scheduler.schedule

    def recording():
        batch = schedule()
        for req, n in batch.items:
            if req.images and req.num_computed_tokens < req.num_prompt_tokens:
                seen.append((req.num_computed_tokens + n, [(im.offset, im.offset + im.length) for im in req.images]))
        return batch

    scheduler.schedule = recording
    return seen


def test_a_repeated_image_is_a_prefix_hit(llm, reference, pictures):
    text = f"Describe {BOI} briefly, and then tell me more about it."  # image at [12, 16), 54 tokens
    _, expected = _expected(reference, text, [pictures[2]])
    first = _generate(llm, text, [pictures[2]])
    runs = llm.engine.encoder_stats.encoder_runs
    again = _generate(llm, text, [pictures[2]])
    assert list(first.outputs[0].token_ids) == list(again.outputs[0].token_ids) == expected
    assert again.num_cached_tokens == 48
    assert llm.engine.encoder_stats.encoder_runs == runs  # every image token came from the cache


def test_a_prefix_hit_stops_before_an_image(llm, reference, pictures):
    text, which = ACROSS_32
    images = [pictures[i] for i in which]
    _, expected = _expected(reference, text, images)
    _generate(llm, text, images)
    again = _generate(llm, text, images)
    assert len(again.prompt_token_ids) == 45
    # Blocks [0, 32) are cached, but 32 falls inside the image at [30, 34): the hit stops at 16.
    assert again.num_cached_tokens == 16
    assert list(again.outputs[0].token_ids) == expected


def test_another_image_is_no_hit(llm, reference, pictures):
    text = f"{BOI} is what, would you say, in a few words?"
    first = _generate(llm, text, [pictures[0]])
    other = _generate(llm, text, [pictures[1]])
    assert other.num_cached_tokens == 0
    assert list(other.outputs[0].token_ids) == _expected(reference, text, [pictures[1]])[1]
    assert list(first.outputs[0].token_ids) != list(other.outputs[0].token_ids)


def test_the_bidirectional_mask_matters(checkpoint, reference, pictures, monkeypatch):
    """With the image tokens' key ends dropped (plain causal attention), some prompt's output
    differs from transformers': the tests above would catch a lost mask."""
    monkeypatch.setattr(model_runner, "image_key_ends", lambda *args: None)
    engine = LLM(str(checkpoint), block_size=16, enable_prefix_caching=False)
    try:
        differ = [text for text, which in PROMPTS
                  if list(_generate(engine, text, [pictures[i] for i in which]).outputs[0].token_ids)
                  != _expected(reference, text, [pictures[i] for i in which])[1]]
    finally:
        engine.close()
    assert differ


def test_a_causal_only_backend_is_refused(checkpoint):
    """The FP8 cache wraps the kernels without passing on key ends: a clear error, not a
    silently causal model."""
    with pytest.raises(ValueError, match="bidirectionally"):
        LLM(str(checkpoint), block_size=16, kv_cache_dtype="fp8")
