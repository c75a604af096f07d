"""Read a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) into
per-module (A, B) pairs with PEFT's scaling folded into B.

PEFT adds `lora_B(lora_A(x)) * scaling` to a target Linear's output, scaling = lora_alpha / r,
or lora_alpha / sqrt(r) with use_rslora; rank_pattern and alpha_pattern override r and alpha per
module, matched as PEFT matches them (a pattern matches a module key that ends with it after a
dot). Anything that changes the computation in other ways (DoRA, LoRA biases, modules_to_save,
embedding targets) is refused rather than silently ignored.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

# PEFT's module name -> (pdserve's fused Llama layer, part of it).
MODULE_PARTS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                "down_proj": ("down_proj", 0)}
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>model\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\."
                  r"(?P<name>\w+))\.lora_(?P<ab>[AB])\.weight$")
_REFUSED_FLAGS = {"use_dora": "DoRA", "lora_bias": "LoRA biases", "fan_in_fan_out": "fan_in_fan_out",
                  "layer_replication": "layer_replication", "modules_to_save": "modules_to_save",
                  "trainable_token_indices": "trainable tokens", "use_qalora": "QA-LoRA"}


class LoRAFormatError(ValueError):
    """The directory is not a LoRA adapter pdserve can apply."""


@dataclass
class LoRAWeights:
    """One adapter on the host: for each (layer index, module name), A [r, in] and B [out, r]
    already multiplied by the module's scaling."""
    name: str
    path: Path
    rank: int
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def read_peft_adapter(name: str, path: str | Path) -> LoRAWeights:
    path = Path(path)
    config = _read_config(path)
    tensors = _read_tensors(path)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    keys: dict[tuple[int, str], str] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None or m["name"] not in MODULE_PARTS:
            raise LoRAFormatError(f"adapter {name!r}: tensor {key!r} targets a module pdserve cannot adapt "
                                  f"(supported: {', '.join(MODULE_PARTS)} of the decoder layers)")
        where = (int(m["layer"]), m["name"])
        pairs.setdefault(where, {})[m["ab"]] = tensor.float()
        keys[where] = m["module"]
    if not pairs:
        raise LoRAFormatError(f"adapter {name!r}: {path} holds no LoRA tensors")
    modules = {}
    for where, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoRAFormatError(f"adapter {name!r}: {keys[where]} lacks its lora_{'AB'[('A' in ab)]} tensor")
        a, b = ab["A"], ab["B"]
        rank = a.shape[0]
        if b.shape[1] != rank:
            raise LoRAFormatError(f"adapter {name!r}: {keys[where]} has lora_A of rank {rank} but lora_B "
                                  f"of shape {tuple(b.shape)}")
        modules[where] = (a, b * module_scaling(config, keys[where], rank))
    rank = max(a.shape[0] for a, _ in modules.values())
    return LoRAWeights(name, path, rank, modules)


def module_scaling(config: dict, module_key: str, rank: int) -> float:
    """PEFT's scaling of one module: alpha / r, or alpha / sqrt(r) with rslora."""
    alpha = config.get("lora_alpha", 8)
    pattern = _pattern_key(config.get("alpha_pattern") or {}, module_key)
    if pattern is not None:
        alpha = config["alpha_pattern"][pattern]
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _pattern_key(patterns: dict, module_key: str) -> str | None:
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", module_key):
            return pattern
    return None


def _read_config(path: Path) -> dict:
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise LoRAFormatError(f"{path} has no adapter_config.json (not a PEFT adapter directory)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise LoRAFormatError(f"{config_file}: {exc}") from exc
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAFormatError(f"{path}: peft_type {config.get('peft_type')!r}; only LORA adapters are supported")
    if config.get("bias", "none") != "none":
        raise LoRAFormatError(f"{path}: bias {config['bias']!r} is not supported (only 'none')")
    for flag, what in _REFUSED_FLAGS.items():
        if config.get(flag):
            raise LoRAFormatError(f"{path}: {what} ({flag}) is not supported")
    return config


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        raise LoRAFormatError(f"{path} has no adapter_model.safetensors")
    with safe_open(str(weights), framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}
