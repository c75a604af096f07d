"""The Qwen2.5-VL vision tower and M-RoPE against transformers, on a tiny random checkpoint.

The tower has 2 blocks, the second in fullatt_block_indexes, and window_size 56 (2x2 merged
units a window), so the 8x10 patch grid of a 112x140 image splits into 6 windows, the last
column of them one unit wide, and the 14x6 grid of a 196x84 image into 8. Weights are drawn
with std 0.2 (transformers' 0.02 leaves the embeddings so small that a wrong window or a
swapped rotary axis would still pass the tolerance).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

from pdserve.models.mrope import MRotaryEmbedding, decode_positions, image_spans, mrope_positions  # noqa: E402
from pdserve.models.qwen2_5_vl_vision import load_vision_tower, vision_spec, window_index  # noqa: E402

IMAGE_TOKEN = 250
SIZES = [(112, 140), (196, 84)]  # (height, width) in pixels


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           fullatt_block_indexes=[1], window_size=56, spatial_merge_size=2, patch_size=14,
                           temporal_patch_size=2),
        image_token_id=IMAGE_TOKEN, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def images():
    rng = np.random.RandomState(0)
    pictures = [Image.fromarray(rng.randint(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]
    processor = transformers.Qwen2VLImageProcessor()
    return [processor(images=[p], return_tensors="pt") for p in pictures] + [processor(images=pictures, return_tensors="pt")]


def test_the_checkpoint_names_the_tower_visual(checkpoint):
    _, path = checkpoint
    from safetensors import safe_open  # only this test reads the file's names
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = [n for n in f.keys() if "visual" in n]
    assert names and all(n.startswith("visual.") for n in names)


def test_window_index_is_transformers(checkpoint, images):
    from transformers.vision_utils import get_vision_window_index  # the reference, test only
    model, _ = checkpoint
    spec = vision_spec(model.config.vision_config)
    grid = images[2]["image_grid_thw"]
    order, bounds = window_index(grid, spec)
    ref_order, ref_bounds = get_vision_window_index(grid, spec.spatial_merge_size, spec.window_size, spec.patch_size)
    assert torch.equal(order, ref_order) and torch.equal(bounds, ref_bounds.long())
    assert len(bounds) - 1 == 6 + 8  # the windows really split both grids


def test_vision_embeddings_equal_transformers(checkpoint, images):
    model, path = checkpoint
    tower = load_vision_tower(model.config, [path / "model.safetensors"])
    assert [tuple(x["image_grid_thw"][0].tolist()) for x in images[:2]] == [(1, 8, 10), (1, 14, 6)]
    for inputs in images:
        pixels, grid = inputs["pixel_values"], inputs["image_grid_thw"]
        with torch.no_grad():
            ref = model.model.visual(pixels, grid_thw=grid).pooler_output
        ours = tower(pixels, grid)
        assert ours.shape == ref.shape == (sum(tower.tokens_per_image(grid)), 64)
        assert ref.abs().max() > 1.0  # the weights are large enough for an error to show
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def _prompt(tokens_per_image: list[int]) -> list[int]:
    """text, <start> image <end>, text, <start> image <end>, text."""
    ids = [5, 6, 7]
    for i, count in enumerate(tokens_per_image):
        ids += [252] + [IMAGE_TOKEN] * count + [253] + list(range(10 + i, 14 + 3 * i))
    return ids


def test_positions_equal_get_rope_index(checkpoint, images):
    model, _ = checkpoint
    grid = images[2]["image_grid_thw"]
    ids = _prompt([20, 21])
    input_ids = torch.tensor([ids])
    ref, ref_delta = model.model.get_rope_index(input_ids, mm_token_type_ids=(input_ids == IMAGE_TOKEN).int(),
                                                image_grid_thw=grid)
    ours, delta = mrope_positions(ids, IMAGE_TOKEN, grid, 2)
    assert torch.equal(ours, ref[:, 0]) and delta == int(ref_delta)
    assert delta < 0  # the images' tokens took fewer positions than their count
    # the first image starts at 4 (3 text tokens, <start>), its 4x5 merged grid ends at 4+4,
    # so <end> resumes at 4 + max(4, 5)
    first = image_spans(ids, IMAGE_TOKEN, [20, 21])[0]
    assert first == (4, 20) and ours[:, first[0] + first[1]].tolist() == [9, 9, 9]
    assert torch.equal(decode_positions(len(ids), 2, delta), (torch.arange(len(ids), len(ids) + 2) + delta).expand(3, -1))


def test_rotary_equals_transformers(checkpoint, images):
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as ref  # the reference, test only
    model, _ = checkpoint
    text = model.config.text_config
    ids = _prompt([20, 21])
    positions, _ = mrope_positions(ids, IMAGE_TOKEN, images[2]["image_grid_thw"], 2)
    torch.manual_seed(1)
    q, k = torch.randn(len(ids), 4, 16), torch.randn(len(ids), 2, 16)
    cos, sin = ref.Qwen2_5_VLRotaryEmbedding(text)(q, positions[:, None, :])
    ref_q, ref_k = ref.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    rope = MRotaryEmbedding(text, 16, text.max_position_embeddings)
    ours_q, ours_k = rope.apply(q, k, *rope.cos_sin(positions, torch.float32))
    torch.testing.assert_close(ours_q, ref_q[0].transpose(0, 1), atol=1e-5, rtol=0)
    torch.testing.assert_close(ours_k, ref_k[0].transpose(0, 1), atol=1e-5, rtol=0)
    # all three axes matter: sections that read one axis only would differ on image tokens
    flat = positions[0].expand(3, -1)
    assert not torch.allclose(rope.cos_sin(flat, torch.float32)[0], rope.cos_sin(positions, torch.float32)[0])
