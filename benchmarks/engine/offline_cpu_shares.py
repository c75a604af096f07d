"""Where pdserve's offline run spends its CPU time, per part of the model: each part's forward
is wrapped to add up process CPU seconds (nested parts are inside their parents' figures).

    .venv/bin/python -m benchmarks.engine.bench_moe_offline --profile --threads 1
"""
from __future__ import annotations

import collections
import time
from pathlib import Path

import torch

PARTS = [  # (module, class, method, label); indented labels are inside the line above them
    ("pdserve.engine.engine", "LLMEngine", "step", "engine step"),
    ("pdserve.models.decoder", "DecoderModel", "forward", "model forward"),
    ("pdserve.models.attention", "PagedAttention", "forward", "  attention block"),
    ("pdserve.engine.model_runner", "AttentionContext", "attention", "    attention kernels (store, prefill, decode)"),
    ("pdserve.models.moe", "SparseMoE", "forward", "  MoE block"),
    ("pdserve.models.moe", "Experts", "forward", "    experts (sort, gather, matmuls, weights, index_add)"),
    ("pdserve.models.moe", "Experts", "_grouped", "      expert matmuls and activation"),
    ("torch.nn", "Linear", "forward", "  nn.Linear (qkv, o, router gate, LM head)"),
    ("pdserve.models.decoder", "DecoderModel", "compute_logits", "  LM head"),
]


def cpu_shares(path: Path, prompts: list[list[int]], new_tokens: int,
               parts: list[tuple[str, str, str, str]] | None = None) -> list[tuple[str, float]]:
    """Run the offline engine once (after a warm-up) with every part timed (PARTS, or the engine
    step and model forward followed by `parts`); return each part's CPU seconds, the engine step
    first."""
    parts = PARTS if parts is None else PARTS[:2] + parts
    import importlib

    from pdserve import LLM, SamplingParams
    spent: collections.Counter = collections.Counter()
    for module, cls, method, label in parts:
        owner = getattr(importlib.import_module(module), cls)
        setattr(owner, method, _timed(getattr(owner, method), label, spent))
    llm = LLM(model=str(path), num_kv_blocks=1024, max_num_batched_tokens=2048)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:32]}], params, use_tqdm=False)
    spent.clear()
    with torch.no_grad():
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(label, spent[label]) for *_, label in parts]


def _timed(fn, label: str, spent: collections.Counter):
    def timed(*args, **kwargs):
        start = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[label] += time.process_time() - start
    return timed
