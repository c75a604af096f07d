"""Rotary position embedding with transformers' own frequency init, so scaled variants
(llama3, linear, ...) match the reference bit for bit."""
from __future__ import annotations

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_type_of(hf_config) -> str:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default"))


class RotaryEmbedding:
    def __init__(self, hf_config, head_dim: int, max_positions: int):
        rope_type = rope_type_of(hf_config)
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
        if rope_type == "default":
            params = getattr(hf_config, "rope_parameters", None) or {}
            base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
            exps = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
            inv_freq, self.scaling = 1.0 / (base ** exps), 1.0
        else:
            # deferred: transformers takes ~1 s to import; only scaled RoPE types need it
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
            inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
        self.inv_freq = inv_freq.float()
        self._table = self._build_table(max_positions)

    def _build_table(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        # on the CPU, where __init__ builds it: an extended table (cover) repeats its rows bit for bit
        freqs = torch.arange(n, dtype=torch.float32)[:, None] * self.inv_freq.cpu()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling

    def cover(self, positions: int) -> None:
        """The table extended to `positions` rows, with the same frequencies: an engine serving
        past the config's max_position_embeddings (--allow-long-max-model-len). Before any CUDA
        graph is captured: a graph keeps the old table's address."""
        cos = self._table[0]
        if positions > cos.shape[0]:
            self._table = tuple(t.to(cos.device) for t in self._build_table(positions))

    def to(self, device: torch.device) -> RotaryEmbedding:
        self.inv_freq = self.inv_freq.to(device)
        self._table = tuple(t.to(device) for t in self._table)
        return self

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._table
        return cos[positions].to(dtype)[:, None, :], sin[positions].to(dtype)[:, None, :]

    @staticmethod
    def apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def cover_positions(model: torch.nn.Module, positions: int) -> None:
    """Every RoPE table the model's modules hold (an attribute, or in a dict or list of them, as
    the per-layer-type models keep theirs) extended to `positions` rows (RotaryEmbedding.cover)."""
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, dict):
                value = list(value.values())
            for rope in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(rope, RotaryEmbedding):
                    rope.cover(positions)
