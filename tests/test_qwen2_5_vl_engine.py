"""Qwen2.5-VL served by pdserve's engine, against transformers' generate on the same tiny random
checkpoint and the same image processor: prompts with one and two images of different sizes,
text before and after, greedy. Then what images change in the engine: chunked prefill cutting
through an image (encoded once, sliced), image keys in the block keys (the same text with
another image never hits the prefix cache, the same image again does), and the encoder cache.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

from pdserve.offline.llm import LLM  # noqa: E402
from pdserve.protocol.sampling_params import SamplingParams  # noqa: E402
from pdserve.testing.vlm_checkpoints import load_qwen2_5_vl_reference, make_qwen2_5_vl  # noqa: E402

SIZES = [(112, 140), (196, 84), (84, 112)]  # (height, width): 20, 21 and 12 image tokens
GREEDY = SamplingParams(max_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_qwen2_5_vl(tmp_path_factory.mktemp("vlm"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    return load_qwen2_5_vl_reference(checkpoint)


@pytest.fixture(scope="module")
def pictures():
    rng = np.random.RandomState(0)
    return [Image.fromarray(rng.randint(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]


def chat(tokenizer, before: str, images: int, after: str) -> str:
    content = [{"type": "text", "text": before}, *[{"type": "image"}] * images, {"type": "text", "text": after}]
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)


def reference_greedy(llm, reference, prompt: str, images, n: int = 8) -> list[int]:
    """transformers' generate on the same expanded prompt and the processor's own pixels."""
    ids, _ = llm.image_prompts.expand(llm.get_tokenizer()(prompt)["input_ids"], images)
    pixels = llm.image_prompts.processor(images=images, return_tensors="pt")
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = reference.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                                 mm_token_type_ids=(input_ids == llm.image_prompts.image_token_id).int(),
                                 max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def generate(llm, prompt: str, images):
    return llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)[0]


CASES = [("Look: ", [0], " what is it?"), ("Two pictures ", [0, 1], " compared."), ("", [1], "?"),
         ("A first, ", [2, 0], "")]


@pytest.mark.parametrize("max_batched", [2048, 16])
def test_greedy_output_equals_transformers(checkpoint, reference, pictures, max_batched):
    """16 tokens a step: every image is cut by a chunk boundary; each is still encoded once."""
    llm = LLM(str(checkpoint), block_size=16, max_num_batched_tokens=max_batched, enable_prefix_caching=False)
    for before, which, after in CASES:
        images = [pictures[i] for i in which]
        prompt = chat(llm.get_tokenizer(), before, len(images), after)
        assert generate(llm, prompt, images).outputs[0].token_ids == reference_greedy(llm, reference, prompt, images), \
            (before, which, after)
    stats = llm.engine.encoder_stats
    assert stats.encoder_runs == 3  # three distinct pictures, each encoded once across every chunk and prompt


def test_another_image_never_hits_and_the_same_image_does(checkpoint, reference, pictures):
    llm = LLM(str(checkpoint), block_size=16)
    prompt = chat(llm.get_tokenizer(), "Please describe this picture: ", 1, " in detail, and nothing else.")
    first = generate(llm, prompt, [pictures[0]])
    other = generate(llm, prompt, [pictures[2]])
    again = generate(llm, prompt, [pictures[0]])
    # <|user|>, 30 bytes of text and <|vision_start|>: the two full blocks before the image are
    # the only ones both share
    assert other.num_cached_tokens == 32
    assert other.outputs[0].token_ids != first.outputs[0].token_ids
    assert other.outputs[0].token_ids == reference_greedy(llm, reference, prompt, [pictures[2]])
    assert again.num_cached_tokens > 32 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.engine.encoder_stats.encoder_runs == 2  # the repeated image came from the cache


def test_without_an_encoder_cache_each_chunk_encodes_again(checkpoint, pictures):
    """The cache is what keeps chunked prefill from encoding per chunk: with it off, the same
    output, more encoder runs."""
    llm = LLM(str(checkpoint), block_size=16, max_num_batched_tokens=16, encoder_cache_tokens=0)
    cached = LLM(str(checkpoint), block_size=16, max_num_batched_tokens=16)
    prompt = chat(llm.get_tokenizer(), "Look: ", 1, " what is it?")
    assert generate(llm, prompt, [pictures[0]]).outputs[0].token_ids == \
        generate(cached, prompt, [pictures[0]]).outputs[0].token_ids
    assert llm.engine.encoder_stats.encoder_runs > 1 == cached.engine.encoder_stats.encoder_runs


def test_images_that_do_not_fit_their_placeholders_are_refused(checkpoint, pictures):
    llm = LLM(str(checkpoint), block_size=16)
    prompt = chat(llm.get_tokenizer(), "Two ", 2, "")
    with pytest.raises(ValueError, match="2 image placeholders for 1 images"):
        generate(llm, prompt, [pictures[0]])
    ids, images = llm.image_prompts.expand(llm.get_tokenizer()(prompt)["input_ids"], pictures[:2])
    with pytest.raises(ValueError, match="placeholder"):
        llm.engine.add_request("shifted", ids, GREEDY, images=[images[0]])  # the second image's tokens unfilled
    text = LLM("builtin:tiny")
    with pytest.raises(ValueError, match="does not take images"):
        text.generate({"prompt": "hi", "multi_modal_data": {"image": pictures[0]}}, GREEDY, use_tqdm=False)


def test_encoding_counts_against_the_step_so_an_image_starts_a_chunk(checkpoint, reference, pictures):
    """32 tokens a step: the first step stops where the image starts (its 20 embeddings and the
    chunk would not both fit), the next starts with it and pays for the encoding; without the
    rule the first step would run 32 tokens through the image. The output stays exact."""
    llm = LLM(str(checkpoint), block_size=16, max_num_batched_tokens=32)
    prompt = chat(llm.get_tokenizer(), "Look: ", 1, " what is it? Say it.")
    ids, images = llm.image_prompts.expand(llm.get_tokenizer()(prompt)["input_ids"], [pictures[0]])
    engine = llm.engine
    req = engine.add_request("r", ids, GREEDY, images=images)
    engine.step()
    assert req.num_computed_tokens == images[0].offset < 32
    engine.step()
    assert engine.scheduler.step_encoder_tokens == images[0].length == 20
    while engine.has_unfinished_requests():
        engine.step()
    assert req.output_token_ids == reference_greedy(llm, reference, prompt, [pictures[0]])
