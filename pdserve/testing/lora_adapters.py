"""Random-weight LoRA adapters made with PEFT, for tests and benchmarks (the soak) alike."""
from __future__ import annotations

from pathlib import Path

import torch

from pdserve.testing.model_factory import load_reference

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Path, out: Path, seed: int, r: int, alpha: float, targets=ALL_MODULES,
                 **lora_options) -> Path:
    """A PEFT adapter of `base` with random A and random (non-zero) B, saved to `out`."""
    return adapter_of(load_reference(base), out, seed, r, alpha, targets, **lora_options)


def adapter_of(model, out: Path, seed: int, r: int, alpha: float, targets=ALL_MODULES, **lora_options) -> Path:
    """make_adapter on a loaded transformers model (PEFT wraps it in place: pass a copy to keep it)."""
    from peft import LoraConfig, get_peft_model  # heavy, and only for making adapters
    torch.manual_seed(seed)
    model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                             init_lora_weights=False, **lora_options))
    with torch.no_grad():  # B at std 0.2: each adapter changes greedy output clearly
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out)
    return out
