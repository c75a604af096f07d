"""The Qwen3.5 vision tower (Qwen3_5VisionModel in transformers 5.24) in plain torch.

Input is what transformers' Qwen2VLImageProcessor gives, as for Qwen2.5-VL
(pdserve.models.qwen2_5_vl_vision): `pixel_values` [patches, C*T*P*P], each merge x merge group
of patches as consecutive rows, and `image_grid_thw` in patches. Output is one embedding per
merged image token, in the placeholders' order.

How it differs from Qwen2.5-VL's tower:
- no window attention: every block attends over each whole frame;
- a learned position embedding on a square grid (num_position_embeddings entries), resampled
  bilinearly (corners aligned) to each image's grid of patches and added after the patch
  embedding, whose convolution has a bias;
- LayerNorms with biases, a plain GELU MLP, and a merger whose LayerNorm runs per patch
  before the merge x merge patches are concatenated.
The 2-D rotary embedding and the attention are Qwen2.5-VL's.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from pdserve.models.qwen2_5_vl_vision import VisionAttention, VisionRotary, frame_seqlens, patch_positions
from pdserve.models.vision_common import HeadDim, load_tower
from pdserve.models.weights import check_fields

# transformers 5 saves the tower under model.visual.*; visual.* as the released checkpoints name it
CHECKPOINT_PREFIXES = ("model.visual.", "visual.")
NORM_EPS = 1e-6  # fixed in transformers' code, not read from the config


@dataclass(frozen=True)
class VisionSpec(HeadDim):
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    rope_theta: float

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2

    @property
    def grid_side(self) -> int:
        return int(self.num_position_embeddings ** 0.5)


def vision_spec(vision_config) -> VisionSpec:
    check_fields(vision_config, {"hidden_act": ("gelu_pytorch_tanh",)})
    rope = getattr(vision_config, "rope_parameters", None) or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"vision rope type {rope.get('rope_type')!r} is not supported; supported: 'axial'")
    c = vision_config
    return VisionSpec(
        depth=c.depth, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_heads=c.num_heads,
        in_channels=c.in_channels, patch_size=c.patch_size, temporal_patch_size=c.temporal_patch_size,
        spatial_merge_size=c.spatial_merge_size, out_hidden_size=c.out_hidden_size,
        num_position_embeddings=c.num_position_embeddings, rope_theta=float(rope.get("rope_theta", 10000.0)))


def _taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps (floor, floor + 1, clamped) and weights on one axis of the side x side
    grid for `index` of `size` target positions, corners aligned (F.interpolate's
    align_corners=True, computed as transformers computes it)."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def position_taps(grid_thw: torch.Tensor, spec: VisionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """[patches, 4] indices into the learned grid and their bilinear weights, per patch in the
    processor's order (merge x merge blocks, the blocks row by row, every frame)."""
    side, indices, weights = spec.grid_side, [], []
    rows_cols = patch_positions(grid_thw, spec.spatial_merge_size)
    start = 0
    for t, h, w in grid_thw.tolist():
        rc = rows_cols[start:start + t * h * w]
        start += t * h * w
        h_taps, h_weights = _taps(rc[:, 0], h, side)
        w_taps, w_weights = _taps(rc[:, 1], w, side)
        indices.append((h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4))
        weights.append((h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4))
    return torch.cat(indices), torch.cat(weights)


class VisionMLP(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.linear_fc1 = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.norm1 = nn.LayerNorm(spec.hidden_size, eps=NORM_EPS)
        self.norm2 = nn.LayerNorm(spec.hidden_size, eps=NORM_EPS)
        self.attn = VisionAttention(spec)
        self.mlp = VisionMLP(spec)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm per patch, then each merge x merge group (consecutive rows) concatenated and
    projected to the language model's width by a GELU MLP."""

    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.width = spec.hidden_size * spec.merge_unit
        self.norm = nn.LayerNorm(spec.hidden_size, eps=NORM_EPS)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, spec.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the exact (erf) GELU here, the tanh one in the blocks' MLPs: as transformers has them
        return self.linear_fc2(F.gelu(self.linear_fc1(self.norm(x).view(-1, self.width))))


class PatchEmbed(nn.Module):
    """The Conv3d (stride = kernel, one kernel per input row) as a matmul, with its bias; the
    weight keeps the Conv3d's shape so that it loads as saved."""

    def __init__(self, spec: VisionSpec):
        super().__init__()
        p, t = spec.patch_size, spec.temporal_patch_size
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(spec.hidden_size, spec.in_channels, t, p, p))
        self.proj.bias = nn.Parameter(torch.empty(spec.hidden_size))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixel_values.to(weight.dtype), weight.reshape(weight.shape[0], -1), self.proj.bias)


class Qwen35VisionTower(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.spec = spec
        self.patch_embed = PatchEmbed(spec)
        self.pos_embed = nn.Embedding(spec.num_position_embeddings, spec.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(spec) for _ in range(spec.depth))
        self.merger = PatchMerger(spec)
        self.rotary = VisionRotary(spec)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """[patches, C*T*P*P], [images, 3] -> [merged tokens, out_hidden_size], in prompt order."""
        grid_thw = grid_thw.cpu().long()
        device = self.patch_embed.proj.weight.device
        x = self.patch_embed(pixel_values.to(device))
        taps, weights = position_taps(grid_thw, self.spec)
        pos = (self.pos_embed(taps.to(device)) * weights.to(device)[:, :, None]).sum(1)
        x = x + pos.to(x.dtype)
        cos, sin = self.rotary.cos_sin(patch_positions(grid_thw, self.spec.spatial_merge_size))
        cos, sin, bounds = cos.to(device), sin.to(device), frame_seqlens(grid_thw)
        for block in self.blocks:
            x = block(x, bounds, cos, sin)
        return self.merger(x)


def _vision_tensors(files: list[Path]):
    """(name within the tower, tensor) for the checkpoint's tower tensors only."""
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                prefix = next((p for p in CHECKPOINT_PREFIXES if name.startswith(p)), None)
                if prefix is not None:
                    yield name[len(prefix):], f.get_tensor(name)


def load_vision_tower(vision_config, files: list[Path], dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> Qwen35VisionTower:
    spec = vision_spec(vision_config)
    # no fused parameter: qkv is fused in the checkpoint already
    return load_tower(lambda: Qwen35VisionTower(spec), [], _vision_tensors(files), dtype, device)
