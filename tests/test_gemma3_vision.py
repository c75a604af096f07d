"""Gemma 3's image encoder (SigLIP tower + projector) and its image attention mask against
transformers, on a tiny random checkpoint.

The tower has 2 layers at width 32 over 64x64 images cut into 8x8 patches (an 8x8 grid), and
mm_tokens_per_image 16, so the projector pools 2x2 patches a token. The text model has 2
layers, one sliding (window 8, shorter than an image's 16 tokens, so the window cuts into the
image's bidirectional block) and one full. Weights are drawn with std 0.2 (transformers' init
leaves the embeddings so small that a wrong pooling order would still pass the tolerance).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from pdserve.models.gemma3_vision import load_image_encoder, vision_spec  # noqa: E402
from pdserve.models.image_masks import gemma3_attention_mask, gemma3_layer_masks, image_block_ids  # noqa: E402

IMAGE_TOKEN, BOI, EOI = 260, 258, 259
TOKENS_PER_IMAGE = 16
SLIDING_WINDOW = 8
SIZES = [(50, 70), (90, 40)]  # (height, width) in pixels, before the processor's resize to 64x64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = transformers.Gemma3Config(
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         sliding_window=SLIDING_WINDOW, layer_types=["sliding_attention", "full_attention"],
                         tie_word_embeddings=False),
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                           image_size=64, patch_size=8, vision_use_head=False),
        mm_tokens_per_image=TOKENS_PER_IMAGE, image_token_index=IMAGE_TOKEN, boi_token_index=BOI,
        eoi_token_index=EOI, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    path = tmp_path_factory.mktemp("gemma3")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def images():
    rng = np.random.RandomState(0)
    pictures = [Image.fromarray(rng.randint(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]
    processor = transformers.Gemma3ImageProcessor(size={"height": 64, "width": 64})
    return [processor(images=[p], return_tensors="pt")["pixel_values"] for p in pictures] + \
        [processor(images=pictures, return_tensors="pt")["pixel_values"]]


def _reference(model, pixels: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model.model.get_image_features(pixels).pooler_output
    return out.reshape(-1, out.shape[-1])


def test_the_checkpoint_names(checkpoint):
    _, path = checkpoint
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = [n for n in f.keys() if not n.startswith("language_model.")]
    assert names and all(n.startswith(("vision_tower.", "multi_modal_projector.")) for n in names)
    assert "multi_modal_projector.mm_input_projection_weight" in names
    assert not any(n.startswith("vision_tower.head.") for n in names)  # vision_use_head=False, as released


def test_image_embeddings_equal_transformers(checkpoint, images):
    model, path = checkpoint
    encoder = load_image_encoder(model.config, [path / "model.safetensors"])
    assert [tuple(p.shape) for p in images] == [(1, 3, 64, 64), (1, 3, 64, 64), (2, 3, 64, 64)]
    for pixels in images:
        ref = _reference(model, pixels)
        ours = encoder(pixels)
        assert ours.shape == ref.shape == (sum(encoder.tokens_per_image(pixels)), 64)
        assert ref.abs().max() > 1.0  # the weights are large enough for an error to show
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    # each image's rows do not depend on the other images of the batch
    torch.testing.assert_close(encoder(images[2]), torch.cat([encoder(images[0]), encoder(images[1])]),
                               atol=1e-5, rtol=0)


def test_released_names_load_the_same(checkpoint, images, tmp_path):
    """The released checkpoints name the tower vision_tower.vision_model.*; a SigLIP head, had a
    checkpoint one, is skipped."""
    model, path = checkpoint
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        tensors = {n.replace("vision_tower.", "vision_tower.vision_model.", 1): f.get_tensor(n) for n in f.keys()}
    tensors["vision_tower.vision_model.head.probe"] = torch.zeros(1, 1, 32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    encoder = load_image_encoder(model.config, [tmp_path / "model.safetensors"])
    torch.testing.assert_close(encoder(images[2]), _reference(model, images[2]), atol=1e-4, rtol=0)


def test_spec_refuses_a_token_count_that_does_not_pool(checkpoint):
    model, _ = checkpoint
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.mm_tokens_per_image = 10
    with pytest.raises(ValueError, match="does not pool"):
        vision_spec(config)


def _prompt() -> list[int]:
    """text, <boi> image <eoi>, text, <boi> image <eoi>, text."""
    image = [BOI] + [IMAGE_TOKEN] * TOKENS_PER_IMAGE + [EOI]
    return [2, 5, 6, 7] + image + [10, 11, 12] + image + [13, 14]


def test_block_ids_equal_transformers():
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask  # the reference, test only
    ids = _prompt()
    ref = get_block_sequence_ids_for_mask(torch.tensor([ids]) == IMAGE_TOKEN)[0]
    ours = image_block_ids(ids, IMAGE_TOKEN)
    assert torch.equal(ours, ref)
    assert sorted(set(ours.tolist())) == [-1, 0, 1]


def test_mask_equals_transformers(checkpoint):
    model, _ = checkpoint
    ids = torch.tensor([_prompt()])
    embeds = model.model.get_input_embeddings()(ids)
    ref = model.create_masks_for_generate(model.config, embeds, attention_mask=None, cache=None, position_ids=None,
                                          token_type_ids=(ids == IMAGE_TOKEN).long())
    ours = gemma3_layer_masks(image_block_ids(ids[0], IMAGE_TOKEN), SLIDING_WINDOW)
    for layer_type in ("full_attention", "sliding_attention"):
        assert ref[layer_type].dtype == torch.bool
        assert torch.equal(ours[layer_type], ref[layer_type][0, 0]), layer_type
    full, n = ours["full_attention"], ids.shape[1]
    first = 5  # the first image's first token
    assert full[first, first + TOKENS_PER_IMAGE - 1]  # an image token sees its image's last token
    assert not full[first, first + TOKENS_PER_IMAGE]  # but not its <eoi>
    assert not full[first + TOKENS_PER_IMAGE - 1, n - 3]  # nor the second image
    assert not ours["sliding_attention"][first + TOKENS_PER_IMAGE - 1, first]  # the window cuts the image
    # a chunk's rows are the whole prompt's rows from its start
    assert torch.equal(gemma3_attention_mask(image_block_ids(ids[0], IMAGE_TOKEN), SLIDING_WINDOW, 30),
                       ours["sliding_attention"][30:])


def test_logits_with_pdserve_embeddings_and_mask_equal_transformers(checkpoint, images):
    """The language model fed pdserve's image rows and pdserve's masks (as explicit 4-D masks)
    gives transformers' forward with the images; a plain causal mask does not."""
    model, path = checkpoint
    encoder = load_image_encoder(model.config, [path / "model.safetensors"])
    pixels = images[2]
    ids = torch.tensor([_prompt()])
    with torch.no_grad():
        ref = model(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == IMAGE_TOKEN).long()).logits[0]

        embeds = model.model.get_input_embeddings()(ids)
        embeds[ids == IMAGE_TOKEN] = encoder(pixels)
        blocks = image_block_ids(ids[0], IMAGE_TOKEN)

        def logits(masks: dict[str, torch.Tensor]) -> torch.Tensor:
            out = model.model.language_model(inputs_embeds=embeds,
                                             attention_mask={k: m[None, None] for k, m in masks.items()})
            return model.lm_head(out.last_hidden_state)[0]

        ours = logits(gemma3_layer_masks(blocks, SLIDING_WINDOW))
        causal = logits(gemma3_layer_masks(torch.full_like(blocks, -1), SLIDING_WINDOW))
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-5)
    assert (causal - ref).abs().max() > 1e-2  # the bidirectional blocks matter
