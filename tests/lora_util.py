"""Random-weight LoRA adapters made with PEFT on a random base (pdserve/testing/model_factory.py), and PEFT's
own greedy generation as the reference pdserve's adapters must match token for token."""
from __future__ import annotations

from pathlib import Path

import torch

from pdserve.testing.model_factory import load_reference

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Path, out: Path, seed: int, r: int, alpha: float, targets=ALL_MODULES,
                 **lora_options) -> Path:
    """A PEFT adapter of `base` with random A and random (non-zero) B, saved to `out`."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    model = get_peft_model(load_reference(base), LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                                            init_lora_weights=False, **lora_options))
    with torch.no_grad():  # B at std 0.2: each adapter changes greedy output clearly
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out)
    return out


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """PEFT's (or, adapter None, transformers') greedy continuation of each prompt."""
    model = load_reference(base)
    if adapter is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, str(adapter)).eval()
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        outs.append(gen[0, len(prompt):].tolist())
    return outs
