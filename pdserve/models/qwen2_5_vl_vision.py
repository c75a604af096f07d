"""The Qwen2.5-VL vision tower (ViT with window attention and a 2x2 patch merger) in plain torch.

Input is what transformers' Qwen2VLImageProcessor gives: `pixel_values` [patches, C*T*P*P],
one row per 14x14 patch (times temporal_patch_size frames), ordered so that each 2x2 group of
patches that the merger fuses is four consecutive rows, and `image_grid_thw` [images, 3] in
patches. Output is one embedding row per merged image token, in the processor's order, which
is the order of the image's placeholder tokens in the prompt.

What makes it more than a plain ViT:
- the blocks run on the patches reordered window by window (window_index), so that a window
  attention layer attends over contiguous runs (cu_window_seqlens); the merger's output is put
  back in the processor's order at the end;
- the layers in fullatt_block_indexes attend over each whole frame instead (cu_seqlens);
- the rotary embedding is 2-D: half of each head's rotary frequencies take the patch's row,
  the other half its column.
Videos (grid t > 1) go through the same code (transformers does the same), but only images
are tested.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from pdserve.models.llama import RMSNorm
from pdserve.models.vision_common import HeadDim, load_tower
from pdserve.models.weights import check_fields

# transformers saves the tower as visual.* (the released checkpoints' names); model.visual.* is
# its module path inside transformers' model, accepted in case a save keeps that.
CHECKPOINT_PREFIXES = ("visual.", "model.visual.")
NORM_EPS = 1e-6  # fixed in transformers' Qwen2.5-VL vision code, not read from the config


@dataclass(frozen=True)
class VisionSpec(HeadDim):
    """The vision_config facts the tower needs."""
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    out_hidden_size: int
    fullatt_block_indexes: tuple[int, ...]
    rope_theta: float

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2


def vision_spec(vision_config) -> VisionSpec:
    check_fields(vision_config, {"hidden_act": ("silu",)})
    rope = getattr(vision_config, "rope_parameters", None) or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"vision rope type {rope.get('rope_type')!r} is not supported; supported: 'axial'")
    c = vision_config
    return VisionSpec(
        depth=c.depth, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_heads=c.num_heads,
        in_channels=c.in_channels, patch_size=c.patch_size, temporal_patch_size=c.temporal_patch_size,
        spatial_merge_size=c.spatial_merge_size, window_size=c.window_size, out_hidden_size=c.out_hidden_size,
        fullatt_block_indexes=tuple(c.fullatt_block_indexes), rope_theta=float(rope.get("rope_theta", 10000.0)))


def frame_seqlens(grid_thw: torch.Tensor) -> torch.Tensor:
    """cu_seqlens of full attention: one segment per frame (h*w patches), as transformers cuts it."""
    lengths = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    return F.pad(lengths.cumsum(0), (1, 0)).long()


def window_index(grid_thw: torch.Tensor, spec: VisionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(the merged units in window order, cu_seqlens of the windows in patches).

    A window is a square of `window_size` pixels, i.e. `side` merged units a side; windows are
    taken row by row over each frame and the units within a window row by row; windows at the
    right and bottom edges are cut short. This is the order transformers' get_vision_window_index
    produces (it pads the grid to whole windows and drops the padding)."""
    side = spec.window_size // spec.spatial_merge_size // spec.patch_size
    order: list[torch.Tensor] = []
    bounds = [0]
    offset = 0
    for t, h, w in grid_thw.tolist():
        mh, mw = h // spec.spatial_merge_size, w // spec.spatial_merge_size
        units = torch.arange(t * mh * mw).reshape(t, mh, mw) + offset
        for frame in units:
            for top in range(0, mh, side):
                for left in range(0, mw, side):
                    window = frame[top:top + side, left:left + side].reshape(-1)
                    order.append(window)
                    bounds.append(bounds[-1] + window.numel() * spec.merge_unit)
        offset += t * mh * mw
    return torch.cat(order), torch.tensor(bounds, dtype=torch.long)


def patch_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """[patches, 2] (row, column) of each patch, in the processor's order: merge x merge blocks
    of patches, the blocks row by row, repeated for every frame."""
    rows = []
    for t, h, w in grid_thw.tolist():
        hpos, wpos = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        blocks = (h // merge, merge, w // merge, merge)
        hpos = hpos.reshape(blocks).transpose(1, 2).flatten()
        wpos = wpos.reshape(blocks).transpose(1, 2).flatten()
        rows.append(torch.stack([hpos, wpos], dim=-1).repeat(t, 1))
    return torch.cat(rows)


class VisionRotary:
    """2-D RoPE: head_dim/4 frequencies, applied to the row then to the column, the pair
    repeated over both halves of the head (rotate-half layout)."""

    def __init__(self, spec: VisionSpec):
        half = spec.head_dim // 2
        # on the CPU explicitly: the tower is built under torch.device("meta")
        exps = torch.arange(0, half, 2, dtype=torch.float, device="cpu") / half
        self.inv_freq = 1.0 / (spec.rope_theta ** exps)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)  # [N, 2, head_dim/4]
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_vision_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim]; rotated in float32 whatever the model dtype (as transformers does)."""
    x32, cos, sin = x.float(), cos[:, None, :].float(), sin[:, None, :].float()
    return (x32 * cos + _rotate_half(x32) * sin).to(x.dtype)


class VisionAttention(nn.Module):
    """Bidirectional attention within each segment of cu_seqlens (a window or a frame)."""

    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.num_heads, self.head_dim = spec.num_heads, spec.head_dim
        self.qkv = nn.Linear(spec.hidden_size, 3 * spec.hidden_size, bias=True)
        self.proj = nn.Linear(spec.hidden_size, spec.hidden_size)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_vision_rotary(q, cos, sin), apply_vision_rotary(k, cos, sin)
        # [heads, N, head_dim]; each segment attends only to itself, so it is its own sdpa call
        # (a block-diagonal mask would cost segments^2 times the work on long images)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        outs = [F.scaled_dot_product_attention(qs, ks, vs, scale=self.head_dim ** -0.5)
                for qs, ks, vs in zip(q.split(lengths, 1), k.split(lengths, 1), v.split(lengths, 1))]
        return self.proj(torch.cat(outs, dim=1).transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    """SwiGLU with biases; gate and up fused into one matmul (the checkpoint keeps them apart)."""

    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.intermediate = spec.intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=True)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.norm1 = RMSNorm(spec.hidden_size, NORM_EPS)
        self.norm2 = RMSNorm(spec.hidden_size, NORM_EPS)
        self.attn = VisionAttention(spec)
        self.mlp = VisionMLP(spec)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """RMSNorm per patch, then each group of merge x merge patches (consecutive rows)
    concatenated and projected to the language model's width by a GELU MLP."""

    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.width = spec.hidden_size * spec.merge_unit
        self.ln_q = RMSNorm(spec.hidden_size, NORM_EPS)
        # a Sequential so that the parameters keep the checkpoint's names (mlp.0, mlp.2)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, spec.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class PatchEmbed(nn.Module):
    """A Conv3d whose stride equals its kernel over inputs of exactly one kernel each: a matmul
    of the flattened patch with the flattened kernel. The weight keeps the Conv3d's shape so
    that it loads as saved."""

    def __init__(self, spec: VisionSpec):
        super().__init__()
        p, t = spec.patch_size, spec.temporal_patch_size
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(spec.hidden_size, spec.in_channels, t, p, p))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixel_values.to(weight.dtype), weight.reshape(weight.shape[0], -1))


class Qwen2_5_VLVisionTower(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.spec = spec
        self.patch_embed = PatchEmbed(spec)
        self.blocks = nn.ModuleList(VisionBlock(spec) for _ in range(spec.depth))
        self.merger = PatchMerger(spec)
        self.rotary = VisionRotary(spec)

    def _to_windows(self, x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """Reorder rows by merged unit (groups of merge_unit consecutive rows stay together)."""
        unit = self.spec.merge_unit
        return x.reshape(-1, unit, x.shape[-1])[order].reshape(x.shape)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """[patches, C*T*P*P], [images, 3] -> [merged tokens, out_hidden_size], in prompt order."""
        grid_thw = grid_thw.cpu().long()
        order, window_bounds = window_index(grid_thw, self.spec)
        frame_bounds = frame_seqlens(grid_thw)
        cos, sin = self.rotary.cos_sin(patch_positions(grid_thw, self.spec.spatial_merge_size))
        device = self.patch_embed.proj.weight.device
        order = order.to(device)
        x = self._to_windows(self.patch_embed(pixel_values.to(device)), order)
        cos, sin = self._to_windows(cos.to(device), order), self._to_windows(sin.to(device), order)
        for i, block in enumerate(self.blocks):
            bounds = frame_bounds if i in self.spec.fullatt_block_indexes else window_bounds
            x = block(x, bounds, cos, sin)
        # back from window order to the processor's (= the placeholders') order
        return self.merger(x)[torch.argsort(order)]

    def tokens_per_image(self, grid_thw: torch.Tensor) -> list[int]:
        """How many placeholder tokens (output rows) each image takes."""
        return (grid_thw.prod(-1) // self.spec.merge_unit).tolist()


def _vision_tensors(files: list[Path]):
    """(name within the tower, tensor) for the checkpoint's vision tensors only: the language
    model's tensors are never read (get_tensor is what reads)."""
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                prefix = next((p for p in CHECKPOINT_PREFIXES if name.startswith(p)), None)
                if prefix is not None:
                    yield name[len(prefix):], f.get_tensor(name)


def load_vision_tower(config, files: list[Path], dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> Qwen2_5_VLVisionTower:
    """The tower of a Qwen2_5_VLForConditionalGeneration config (or its vision_config),
    with its weights from the checkpoint's safetensors files."""
    spec = vision_spec(getattr(config, "vision_config", config))
    # gate_up_proj is the only fused parameter (qkv is fused in the checkpoint already)
    return load_tower(lambda: Qwen2_5_VLVisionTower(spec), [spec.intermediate_size] * 2, _vision_tensors(files),
                      dtype, device)
