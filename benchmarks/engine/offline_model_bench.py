"""What bench_moe_offline.py and bench_mla_offline.py share: a random-weight checkpoint built
from a config with transformers, the workload (random prompts of a random length each), and
pdserve's timed offline run. Each script adds its own transformers side and table."""
from __future__ import annotations

import random
import time
from pathlib import Path

import torch


def build_model(root: Path, model_type: str, architecture: str, config: dict) -> tuple[Path, int]:
    """Save a random model of this shape (seed 0) under root; return root and its parameter count."""
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    hf_config = AutoConfig.for_model(model_type, **config, architectures=[architecture])
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    model.save_pretrained(root)
    return root, sum(p.numel() for p in model.parameters())


def workload(n: int, lo: int, hi: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """n prompts of lo..hi random token ids each (the same ones for a given seed)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_pdserve(path: Path, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """Output tokens/s of one greedy offline generate over all prompts (after a short warm-up
    generate, which the timing leaves out), and each request's tokens."""
    from pdserve import LLM, SamplingParams
    llm = LLM(model=str(path), num_kv_blocks=1024, max_num_batched_tokens=2048)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:32]}], params, use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return len(prompts) * new_tokens / elapsed, [o.outputs[0].token_ids for o in outs]
