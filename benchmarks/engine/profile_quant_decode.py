"""Where a decode step's time goes at one request: SmolLM2-135M-Instruct's Q4_1 GGUF, offline, the
weights kept quantized. Times every quantized matmul (by layer), the paged attention and the whole
engine step of one request's decode steps, and reports per step the median of each part and the
remainder (the Python and torch work between the kernels: norms, RoPE, KV store, sampling).
The compiled decode step (native_decode) runs the layers inside one call, so only the LM head is
timed apart; --python-layers runs them in Python to see each part.

    .venv/bin/python -m benchmarks.engine.profile_quant_decode [--threads 2] [--new-tokens 64]

The machine is shared: medians over the steps, and the fastest step, are both printed.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

LAYER_BY_ROWS = {960: "qkv_proj", 576: "o_proj / down_proj", 3072: "gate_up_proj", 49152: "lm_head"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--python-layers", action="store_true",
                    help="run the layers in Python (the compiled decode step hides the per-layer parts)")
    args = ap.parse_args()
    os.environ.update(OMP_NUM_THREADS=str(args.threads), NUMBA_NUM_THREADS=str(args.threads))
    import torch

    from pdserve import LLM, SamplingParams
    from pdserve.kernels import numba_ops, quant_cpu
    from pdserve.models.gguf import DEFAULT_MODEL
    torch.set_num_threads(args.threads)

    step_parts: list[dict[str, float]] = []
    current: dict[str, float] = collections.defaultdict(float)

    def timed(fn, key_of):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            current[key_of(a, out)] += time.perf_counter() - t0
            return out
        return wrapper

    # The layers call packed_matmul (quant_matmul in older checkouts, which bench_quant_ab.py runs).
    entry = "packed_matmul" if hasattr(quant_cpu, "packed_matmul") else "quant_matmul"
    setattr(quant_cpu, entry, timed(getattr(quant_cpu, entry),
                                    lambda a, out: LAYER_BY_ROWS.get(out.shape[-1], f"{out.shape[-1]} rows")))
    numba_ops.paged_decode_attention = timed(numba_ops.paged_decode_attention, lambda a, out: "attention")
    llm = LLM(DEFAULT_MODEL, num_kv_blocks=256, enable_prefix_caching=False)
    engine = llm.engine
    if args.python_layers:
        engine.model.native_decode = None
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(1000, 1000 + args.prompt_len))}],
                 SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)  # warm up
    engine.add_request("profiled", list(range(2000, 2000 + args.prompt_len)), params)
    while engine.has_unfinished_requests():
        current.clear()
        t0 = time.perf_counter()
        engine.step()
        current["step"] = time.perf_counter() - t0
        step_parts.append(dict(current))
    decode = step_parts[1:]  # the first step is the prefill
    report(decode, args)


def report(steps: list[dict[str, float]], args) -> None:
    keys = sorted({k for s in steps for k in s if k != "step"})
    fastest = min(steps, key=lambda s: s["step"])
    print(f"{len(steps)} decode steps of one request ({args.prompt_len}-token prompt), {args.threads} threads")
    print(f"{'part':>22} {'median ms':>10} {'share':>6} {'fastest step ms':>16}")
    median_step = statistics.median(s["step"] for s in steps)
    for k in keys:
        m = statistics.median(s.get(k, 0.0) for s in steps)
        print(f"{k:>22} {m * 1e3:10.2f} {m / median_step:6.0%} {fastest.get(k, 0.0) * 1e3:16.2f}")
    rest = statistics.median(s["step"] - sum(v for kk, v in s.items() if kk != "step") for s in steps)
    print(f"{'rest (Python, torch)':>22} {rest * 1e3:10.2f} {rest / median_step:6.0%} "
          f"{(fastest['step'] - sum(v for kk, v in fastest.items() if kk != 'step')) * 1e3:16.2f}")
    print(f"{'whole step':>22} {median_step * 1e3:10.2f} {1:6.0%} {fastest['step'] * 1e3:16.2f}")


if __name__ == "__main__":
    main()
