"""Random-weight LoRA adapters made with PEFT on a random base (pdserve/testing/lora_adapters.py), and PEFT's
own greedy generation as the reference pdserve's adapters must match token for token."""
from __future__ import annotations

from pathlib import Path

import torch

from pdserve.testing.lora_adapters import make_adapter  # noqa: F401 (the tests import it from here)
from pdserve.testing.model_factory import load_reference


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """PEFT's (or, adapter None, transformers') greedy continuation of each prompt."""
    return peft_greedy_of(load_reference(base), adapter, prompts, new_tokens)


def peft_greedy_of(model, adapter: Path | None, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """peft_greedy on a loaded transformers model (PEFT wraps it in place: pass a copy to keep it)."""
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
