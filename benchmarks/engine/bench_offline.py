"""Offline throughput: pdserve vs transformers' continuous batching vs plain generate, in one run.

Workload: 64 requests, prompts of 32-512 tokens, 64 new tokens each, ignore_eos, on a
~32M-parameter Llama (hidden 512, 8 layers, 8 heads, 4 KV heads, vocab 8192), float32 on CPU.
--model runs the same workload on another checkpoint: a Hugging Face directory, or a GGUF (which
transformers loads with gguf_file=, dequantized to float32 as pdserve does), e.g. the default model:

    .venv/bin/python -m benchmarks.engine.bench_offline --repeats 3
    .venv/bin/python -m benchmarks.engine.bench_offline --repeats 3 --model SmolLM2-135M-Instruct
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.support.bench_model import BLOCK_TOKENS, KV_BLOCKS, build_model, workload


def hf_source(model: str) -> tuple[str, dict]:
    """What transformers' from_pretrained takes for a pdserve --model: a directory, or a GGUF's
    directory and file name."""
    from pdserve.models.gguf import find_gguf_file
    gguf = find_gguf_file(model)
    if gguf is None:
        return model, {}
    return str(gguf.parent), dict(gguf_file=gguf.name, dtype=torch.float32)


HF_PAGE_TOKENS = 256


def run_pdserve(path: Path, prompts, new_tokens: int, batched_tokens: int) -> float:
    from pdserve import LLM, SamplingParams
    llm = LLM(model=str(path), num_kv_blocks=KV_BLOCKS, block_size=BLOCK_TOKENS, max_num_batched_tokens=batched_tokens)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:32]}], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    return len(prompts) * new_tokens / elapsed


def run_hf_continuous_batching(path: Path, prompts, new_tokens: int) -> float:
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    source, extra = hf_source(str(path))
    model = AutoModelForCausalLM.from_pretrained(source, attn_implementation="paged|sdpa", **extra).eval()
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
                              pad_token_id=0, use_cuda_graph=False)
    start = time.perf_counter()
    with torch.no_grad():
        # An explicit cache size: left to itself, generate_batch sizes its cache to 90% of the
        # free memory (checked: 14.5 GB on SmolLM2, which a shared machine's OOM killer ended).
        cache = ContinuousBatchingConfig(page_size=HF_PAGE_TOKENS,
                                         num_blocks=KV_BLOCKS * BLOCK_TOKENS // HF_PAGE_TOKENS)
        out = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False,
                                   continuous_batching_config=cache)
    elapsed = time.perf_counter() - start
    produced = sum(len(r.generated_tokens) for r in out.values())
    return produced / elapsed


def run_hf_generate(path: Path, prompts, new_tokens: int) -> float:
    from transformers import AutoModelForCausalLM
    source, extra = hf_source(str(path))
    model = AutoModelForCausalLM.from_pretrained(source, **extra).eval()
    start = time.perf_counter()
    produced = 0
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            produced += out.shape[1] - len(p)
    return produced / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--plain-generate-requests", type=int, default=8,
                    help="plain generate is one request at a time: time a subset")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--skip-peers", action="store_true")
    ap.add_argument("--model", default=None,
                    help="a checkpoint to run instead of the random 32M Llama: a Hugging Face directory, a GGUF "
                         "file or SmolLM2-135M-Instruct (the default model)")
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    path = Path(args.model) if args.model else build_model(Path(tempfile.mkdtemp()) / "llama-32m")
    prompts = workload(args.requests, 32, 512, vocab=_vocab_size(path))
    rows: dict[str, list[float]] = {"pdserve": [], "transformers generate_batch (paged|sdpa)": [],
                                    "transformers generate, one at a time": []}
    for r in range(args.repeats):
        rows["pdserve"].append(run_pdserve(path, prompts, args.new_tokens, args.max_num_batched_tokens))
        if not args.skip_peers:
            rows["transformers generate_batch (paged|sdpa)"].append(run_hf_continuous_batching(path, prompts, args.new_tokens))
            rows["transformers generate, one at a time"].append(
                run_hf_generate(path, prompts[:args.plain_generate_requests], args.new_tokens))
        print(f"run {r + 1}: " + ", ".join(f"{k}={v[-1]:.1f}" for k, v in rows.items() if v), flush=True)
    print_table(rows)


def _vocab_size(path: Path) -> int:
    from pdserve.models.loader import load_hf_config, resolve_model_path
    return load_hf_config(resolve_model_path(str(path))).vocab_size


def print_table(rows: dict[str, list[float]]) -> None:
    base = statistics.median(rows["transformers generate_batch (paged|sdpa)"] or [float("nan")])
    print(f"\n| engine | output tokens/s (median of {len(rows['pdserve'])}) | vs generate_batch |")
    print("|---|---:|---:|")
    for name, values in rows.items():
        if values:
            med = statistics.median(values)
            print(f"| {name} | {med:.1f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
