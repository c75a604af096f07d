"""Qwen3.5 with images (Qwen3_5ForConditionalGeneration) served by pdserve's engine, against
transformers' generate on the same tiny random checkpoint and image processor, greedy, float32:
the hybrid language model (Gated DeltaNet state beside paged KV) with the tower's embeddings in
its image placeholders and interleaved M-RoPE positions. Prompts with one and two images of
different sizes and text around them; chunked prefill cutting through an image and through the
delta rule's 64-token chunks; a batch of requests of different lengths; a prefix cached with its
state snapshot, taken only by a prompt with the same image; tensor parallelism.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

from pdserve.offline.llm import LLM  # noqa: E402
from pdserve.protocol.sampling_params import SamplingParams  # noqa: E402
from pdserve.testing.vlm_chat import random_pictures  # noqa: E402
from pdserve.testing.vlm_checkpoints import load_qwen3_5_vl_reference, make_qwen3_5_vl  # noqa: E402

NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
CASES = [("Look: ", [0], " what is it?"), ("Two pictures ", [0, 1], " compared, in many words please."),
         ("", [1], "?"), ("A first, ", [2, 0], "")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_qwen3_5_vl(tmp_path_factory.mktemp("qwen3_5_vl"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    return load_qwen3_5_vl_reference(checkpoint)


@pytest.fixture(scope="module")
def pictures():
    return random_pictures(seed=0)


def chat(tokenizer, before: str, images: int, after: str) -> str:
    content = [{"type": "text", "text": before}, *[{"type": "image"}] * images, {"type": "text", "text": after}]
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)


def reference_greedy(llm, reference, prompt: str, images) -> list[int]:
    """transformers' generate on the same expanded prompt and the processor's own pixels."""
    ids, _ = llm.image_prompts.expand(llm.get_tokenizer()(prompt)["input_ids"], images)
    input_ids = torch.tensor([ids])
    kwargs = {}
    if images:
        pixels = llm.image_prompts.processor(images=images, return_tensors="pt")
        kwargs = dict(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                      mm_token_type_ids=(input_ids == llm.image_prompts.image_token_id).int())
    with torch.no_grad():
        out = reference.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
    return out[0, len(ids):].tolist()


def request(llm, prompt: str, images):
    return {"prompt": prompt, "multi_modal_data": {"image": images}} if images else {"prompt": prompt}


@pytest.mark.parametrize("max_batched", [2048, 16])
def test_greedy_output_equals_transformers(checkpoint, reference, pictures, max_batched):
    """All prompts in one batch (decode of different lengths together); at 16 tokens a step every
    image is cut by a chunk boundary, the state carried across each cut."""
    llm = LLM(str(checkpoint), block_size=16, max_num_batched_tokens=max_batched, max_num_seqs=3,
              enable_prefix_caching=False)
    prompts = [(chat(llm.get_tokenizer(), before, len(which), after), [pictures[i] for i in which])
               for before, which, after in CASES]
    prompts.append((chat(llm.get_tokenizer(), "text only, long enough to cross a chunk: " * 2, 0, ""), []))
    outs = llm.generate([request(llm, p, ims) for p, ims in prompts], GREEDY, use_tqdm=False)
    for (prompt, images), out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference_greedy(llm, reference, prompt, images), prompt
    assert llm.engine.encoder_stats.encoder_runs == 3  # three distinct pictures, each encoded once
    assert llm.engine.kv.states.num_in_use() == 0


def test_prefix_with_its_state_is_taken_only_with_the_same_image(checkpoint, reference, pictures):
    """A long prompt prefilled in 16-token steps leaves state snapshots at its block boundaries;
    the same prompt again takes blocks and state past the image, another image takes only the
    text before it. Both equal transformers."""
    llm = LLM(str(checkpoint), block_size=16, max_num_batched_tokens=16)
    prompt = chat(llm.get_tokenizer(), "Please describe this picture: ", 1, " in detail, and nothing else.")
    first = llm.generate(request(llm, prompt, [pictures[0]]), GREEDY, use_tqdm=False)[0]
    again = llm.generate(request(llm, prompt, [pictures[0]]), GREEDY, use_tqdm=False)[0]
    other = llm.generate(request(llm, prompt, [pictures[2]]), GREEDY, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == reference_greedy(llm, reference, prompt, [pictures[0]])
    assert again.num_cached_tokens > 32 and again.outputs[0].token_ids == first.outputs[0].token_ids
    # <|user|>, 30 bytes of text and <|vision_start|>: the two blocks before the image
    assert other.num_cached_tokens == 32
    assert other.outputs[0].token_ids == reference_greedy(llm, reference, prompt, [pictures[2]])


def test_interleaved_sections_differ_from_contiguous_ones(checkpoint):
    """The axis of each rotary frequency: Qwen3.5 interleaves what Qwen2.5-VL keeps contiguous."""
    from pdserve.models.loader import load_hf_config
    from pdserve.models.qwen3_5_vl import InterleavedMRotaryEmbedding
    rope = InterleavedMRotaryEmbedding(load_hf_config(checkpoint), 16, 64)
    assert rope._axis.tolist() == [0, 1, 2, 0, 1, 2, 0, 0] * 2  # mrope_section [4, 2, 2]


def test_tensor_parallel_greedy_equals_transformers(checkpoint, reference, pictures):
    """At TP 2 the language model splits as the text model's (each rank its delta-rule and
    attention heads) and the tower stays on rank 0, which encodes and sends the embeddings: prompts
    with one and two images, one cut by 16-token steps, give transformers' tokens."""
    llm = LLM(str(checkpoint), tensor_parallel_size=2, block_size=16, max_num_batched_tokens=16, max_num_seqs=2,
              enable_prefix_caching=False)
    try:
        mixer = next(layer.mixer for layer in llm.engine.model.layers if hasattr(layer.mixer, "conv_parts"))
        assert 2 * mixer.conv_size == mixer.full_conv_size, "rank 0 is not split"
        prompts = [(chat(llm.get_tokenizer(), before, len(which), after), [pictures[i] for i in which])
                   for before, which, after in CASES[:2]]
        outs = llm.generate([request(llm, p, ims) for p, ims in prompts], GREEDY, use_tqdm=False)
        for (prompt, images), out in zip(prompts, outs):
            assert out.outputs[0].token_ids == reference_greedy(llm, reference, prompt, images), prompt
        assert llm.engine.kv.states.num_in_use() == 0
    finally:
        llm.close()
