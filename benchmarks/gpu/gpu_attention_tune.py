"""Launch options of the Triton paged decode attention, timed on the 1.1B model's decode shape
(32 heads, 4 KV heads, head_dim 64, bf16, block 16) with --seqs sequences of --ctx tokens.

    python3 -m benchmarks.gpu.gpu_attention_tune [--out DIR --seqs 256 --ctx 540]

Reads the K/V of one layer from a strided per-layer view of a 22-layer block-major cache with
shuffled block tables, as the engine does; reports GB/s of K/V read per config (median of
--reps CUDA-event-timed calls) and checks each config's output against the default launch.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

import torch

from pdserve.kernels import triton_ops


def setup(seqs: int, ctx: int, layers: int = 22, block: int = 16):
    per_seq = -(-ctx // block)
    cache = torch.randn(seqs * per_seq, layers, 2, block, 4, 64, dtype=torch.bfloat16, device="cuda")
    tables = torch.randperm(seqs * per_seq, device="cuda").view(seqs, per_seq).to(torch.int32)
    lens = torch.full((seqs,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(seqs, 32, 64, dtype=torch.bfloat16, device="cuda")
    return q, cache[:, 3, 0], cache[:, 3, 1], tables, lens


def time_config(args_, tuning, reps: int) -> float:
    times = []
    for i in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        triton_ops.paged_decode_attention(*args_, 0.125, tuning=tuning)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=".")
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=540)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    q, k_cache, v_cache, tables, lens = setup(args.seqs, args.ctx)
    inputs = (q, k_cache, v_cache, tables, lens)
    kv_bytes = args.seqs * args.ctx * 4 * 64 * 2 * 2
    reference = triton_ops.paged_decode_attention(*inputs, 0.125)
    rows = []
    for block_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3, 4)):
        tuning = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
        try:
            out = triton_ops.paged_decode_attention(*inputs, 0.125, tuning=tuning)
            ok = torch.allclose(out.float(), reference.float(), atol=2e-2, rtol=2e-2)
            seconds = time_config(inputs, tuning, args.reps)
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is recorded
            rows.append({**tuning, "error": repr(exc)[:200]})
            continue
        rows.append({**tuning, "us": seconds * 1e6, "gbps": kv_bytes / seconds / 1e9, "matches": ok})
    default = {"us": time_config(inputs, None, args.reps) * 1e6}
    default["gbps"] = kv_bytes / default["us"] * 1e-3
    good = sorted((r for r in rows if r.get("matches")), key=lambda r: r["us"])
    result = {"seqs": args.seqs, "ctx": args.ctx, "kv_bytes": kv_bytes, "default": default,
              "best": good[:5], "all": rows}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "attention_tune.json").write_text(json.dumps(result, indent=1))
    print("default", json.dumps(default))
    for r in good[:8]:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
