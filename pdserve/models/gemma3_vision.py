"""Gemma 3's image encoder in plain torch: the SigLIP vision tower and the multimodal projector.

Input is what transformers' Gemma3ImageProcessor gives: `pixel_values` [images, C, H, W], every
image resized to the tower's square `image_size` (pan-and-scan crops, when the processor makes
them, are more images of the same size). Output is one embedding row per image placeholder
token, `mm_tokens_per_image` rows an image, images in order: the rows that replace the prompt's
image tokens, in the text model's width. transformers computes the same rows as
`Gemma3ForConditionalGeneration.get_image_features(pixel_values).pooler_output` (shaped
[images, tokens, hidden] there).

The tower (SigLIP, no class token, no pooling head):
- the patch embedding is a Conv2d whose stride equals its kernel, so it is one matmul of each
  flattened patch with the flattened kernel (plus its bias);
- learned absolute position embeddings, one per patch, row by row (no interpolation: Gemma 3
  always feeds `image_size` pixels);
- pre-norm encoder layers: LayerNorm, attention with biases over all the image's patches
  (bidirectional), LayerNorm, a GELU-tanh MLP;
- a final LayerNorm (post_layernorm).
The projector: average pooling of the patch grid down to sqrt(mm_tokens_per_image) a side, an
RMSNorm that scales by (1 + weight) (Gemma's), and a matmul with `mm_input_projection_weight`
[vision hidden, text hidden] (a bare parameter, not a Linear: it is stored transposed).

The attention rule the language model then applies over the image tokens lives in
pdserve/models/image_masks.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from pdserve.models.gemma3 import GemmaRMSNorm
from pdserve.models.vision_common import HeadDim, load_tower
from pdserve.models.weights import check_fields

# Checkpoint name prefixes -> module prefix, longest first. The released Gemma 3 checkpoints
# name the tower vision_tower.vision_model.* (SiglipVisionModel's old module path); transformers
# 5.24 saves it as vision_tower.*, and model.* is its module path inside transformers' model.
# vision_tower.head.* (SigLIP's attention-pooling head) is never used by Gemma 3 and is skipped.
CHECKPOINT_PREFIXES = (
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."),
)
SKIPPED = ("vision_tower.head.",)


@dataclass(frozen=True)
class Gemma3VisionSpec(HeadDim):
    """The vision_config facts (and the two top-level ones) the encoder needs."""
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    mm_tokens_per_image: int
    text_hidden_size: int

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side ** 2

    @property
    def tokens_per_side(self) -> int:
        return int(self.mm_tokens_per_image ** 0.5)

    @property
    def pool_kernel(self) -> int:
        return self.patches_per_side // self.tokens_per_side


def vision_spec(config) -> Gemma3VisionSpec:
    """From a Gemma3Config (a Gemma3ForConditionalGeneration checkpoint's config)."""
    v = config.vision_config
    check_fields(v, {"hidden_act": ("gelu_pytorch_tanh",)})
    image_size, patch_size = v.image_size, v.patch_size
    if not isinstance(image_size, int) or not isinstance(patch_size, int):
        raise ValueError(f"non-square image_size {image_size!r} / patch_size {patch_size!r} is not supported")
    spec = Gemma3VisionSpec(
        hidden_size=v.hidden_size, intermediate_size=v.intermediate_size, num_layers=v.num_hidden_layers,
        num_heads=v.num_attention_heads, num_channels=v.num_channels, image_size=image_size,
        patch_size=patch_size, layer_norm_eps=float(v.layer_norm_eps),
        mm_tokens_per_image=int(config.mm_tokens_per_image), text_hidden_size=config.text_config.hidden_size)
    # transformers pools with kernel = patches_per_side // int(sqrt(tokens)); the pooled grid
    # must come out at exactly mm_tokens_per_image, the placeholder count of an image
    if spec.pool_kernel < 1 or (spec.patches_per_side // spec.pool_kernel) ** 2 != spec.mm_tokens_per_image:
        raise ValueError(f"mm_tokens_per_image {spec.mm_tokens_per_image} does not pool from a "
                         f"{spec.patches_per_side}x{spec.patches_per_side} patch grid")
    return spec


class PatchEmbedding(nn.Module):
    """Conv2d(C, D, kernel=stride=P) as a matmul; the weight keeps the Conv2d's shape so that it
    loads as saved."""

    def __init__(self, spec: Gemma3VisionSpec):
        super().__init__()
        self.patch_size = spec.patch_size
        self.weight = nn.Parameter(torch.empty(spec.hidden_size, spec.num_channels, spec.patch_size, spec.patch_size))
        self.bias = nn.Parameter(torch.empty(spec.hidden_size))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] -> [B, (H/P)*(W/P), D], patches row by row (Conv2d's flatten order)."""
        b, c, h, w = pixel_values.shape
        p = self.patch_size
        patches = pixel_values.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        patches = patches.reshape(b, (h // p) * (w // p), c * p * p)
        return F.linear(patches.to(self.weight.dtype), self.weight.reshape(self.weight.shape[0], -1), self.bias)


class VisionEmbeddings(nn.Module):
    def __init__(self, spec: Gemma3VisionSpec):
        super().__init__()
        self.patch_embedding = PatchEmbedding(spec)
        self.position_embedding = nn.Embedding(spec.num_patches, spec.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.patch_embedding(pixel_values) + self.position_embedding.weight


class VisionAttention(nn.Module):
    """Bidirectional attention over one image's patches; q, k and v fused into one matmul (the
    checkpoint keeps them apart), all with biases."""

    def __init__(self, spec: Gemma3VisionSpec):
        super().__init__()
        self.num_heads, self.head_dim = spec.num_heads, spec.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, 3 * spec.hidden_size, bias=True)
        self.out_proj = nn.Linear(spec.hidden_size, spec.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        # [3, B, heads, N, head_dim]
        q, k, v = self.qkv_proj(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class VisionMLP(nn.Module):
    def __init__(self, spec: Gemma3VisionSpec):
        super().__init__()
        self.fc1 = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=True)
        self.fc2 = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class EncoderLayer(nn.Module):
    def __init__(self, spec: Gemma3VisionSpec):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.self_attn = VisionAttention(spec)
        self.layer_norm2 = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.mlp = VisionMLP(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipVisionTower(nn.Module):
    """[B, C, H, W] -> [B, patches, vision hidden], after post_layernorm."""

    def __init__(self, spec: Gemma3VisionSpec):
        super().__init__()
        self.embeddings = VisionEmbeddings(spec)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(EncoderLayer(spec) for _ in range(spec.num_layers))
        self.post_layernorm = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class MultiModalProjector(nn.Module):
    """Average-pool the patch grid to tokens_per_side a side, RMSNorm (1 + w), project to the
    text model's width."""

    def __init__(self, spec: Gemma3VisionSpec):
        super().__init__()
        self.side, self.kernel = spec.patches_per_side, spec.pool_kernel
        self.mm_input_projection_weight = nn.Parameter(torch.empty(spec.hidden_size, spec.text_hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(spec.hidden_size, spec.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, patches, D] -> [B, mm_tokens_per_image, text hidden]."""
        b, _, d = x.shape
        grid = x.transpose(1, 2).reshape(b, d, self.side, self.side)
        pooled = F.avg_pool2d(grid, kernel_size=self.kernel, stride=self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(x)


class Gemma3ImageEncoder(nn.Module):
    def __init__(self, spec: Gemma3VisionSpec):
        super().__init__()
        self.spec = spec
        self.vision_tower = SiglipVisionTower(spec)
        self.multi_modal_projector = MultiModalProjector(spec)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, C, image_size, image_size] -> [images * mm_tokens_per_image, text hidden],
        image by image, each image's rows in its placeholders' order."""
        size = self.spec.image_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (self.spec.num_channels, size, size):
            raise ValueError(f"pixel_values must be [images, {self.spec.num_channels}, {size}, {size}] "
                             f"(what Gemma3ImageProcessor gives), got {tuple(pixel_values.shape)}")
        weight = self.multi_modal_projector.mm_input_projection_weight
        out = self.multi_modal_projector(self.vision_tower(pixel_values.to(weight.device)))
        return out.reshape(-1, out.shape[-1])

    def tokens_per_image(self, pixel_values: torch.Tensor) -> list[int]:
        """How many placeholder tokens (output rows) each image takes: the same for all."""
        return [self.spec.mm_tokens_per_image] * pixel_values.shape[0]


def _checkpoint_name(name: str) -> str | None:
    """The module name of a checkpoint tensor of the encoder, or None for any other tensor."""
    for prefix, target in CHECKPOINT_PREFIXES:
        if name.startswith(prefix):
            local = target + name[len(prefix):]
            return None if local.startswith(SKIPPED) else local
    return None


def _encoder_tensors(files: list[Path]):
    """(module name, tensor) for the encoder's tensors only: the language model's tensors are
    never read (get_tensor is what reads)."""
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                local = _checkpoint_name(name)
                if local is not None:
                    yield local, f.get_tensor(name)


def load_image_encoder(config, files: list[Path], dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu") -> Gemma3ImageEncoder:
    """The tower and projector of a Gemma3ForConditionalGeneration config, with their weights
    from the checkpoint's safetensors files."""
    spec = vision_spec(config)
    # qkv_proj is the only fused parameter: q, k and v are each hidden_size rows
    return load_tower(lambda: Gemma3ImageEncoder(spec), [spec.hidden_size] * 3, _encoder_tensors(files),
                      dtype, device)
