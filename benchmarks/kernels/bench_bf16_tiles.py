"""Unquantized weights' bf16 products at 16-2048 rows on SmolLM2's shapes: oneDNN's F.linear with
the float32 -> bf16 -> float32 conversions the Python layers pay, the compiled gemv's AMX tiles
copying and transposing the bf16 rows every call, and the same tiles loaded from the pack made
once (pdserve.kernels.native_matrices.bf16_tiles). Needs AMX. Milliseconds a call (the median of
10 calls), medians of --repeats rounds with the three timed in turn.

    .venv/bin/python -m benchmarks.kernels.bench_bf16_tiles [--rows 16 32 128 512 2048] [--repeats 5]
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from benchmarks.kernels.bench_cpu_layer_ops import median_us
from pdserve.kernels.dequant_tiles import native_amx, set_tile_dtype
from pdserve.kernels.native_matrices import bf16_rows_matmul, bf16_tiles

SHAPES = {"qkv 960 x 576": (960, 576), "gate_up 3072 x 576": (3072, 576), "down 576 x 1536": (576, 1536),
          "LM head 49152 x 576": (49152, 576)}


def _ms(fn) -> float:
    return median_us(fn, calls=10) / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[16, 32, 128, 512, 2048])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    if not native_amx():
        raise SystemExit("no AMX on this CPU")
    set_tile_dtype(torch.bfloat16)
    print(f"threads {torch.get_num_threads()}\n\n| rows | matrix | oneDNN + conversions | tiles, copied a call "
          "| tiles from the pack |\n|---:|---|---:|---:|---:|")
    for rows in args.rows:
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k).to(torch.bfloat16)
            tiles, x = bf16_tiles(w), torch.randn(rows, k)
            runs = [(_ms(lambda: F.linear(x.to(torch.bfloat16), w).float()), _ms(lambda: bf16_rows_matmul(x, w)),
                     _ms(lambda: bf16_rows_matmul(x, w, tiles))) for _ in range(args.repeats)]
            cells = [statistics.median(r[i] for r in runs) for i in range(3)]
            print(f"| {rows} | {name} | " + " | ".join(f"{c:.3f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
