"""Where a quantized matrix's bf16 products leave the compiled kernel for oneDNN: SmolLM2-135M's
four Q4_1 layer matrices (qkv, o, gate_up, down) and its Q8_0 LM head under bf16 products, through
the compiled kernel (native_gemv_amx.c on AMX: each task's 32 rows dequantized in cache) and
through dequantized tiles and oneDNN (dequant_tiles: a whole-matrix tile for a layer's matrices,
as bf16_mlp and bf16_rows take them; tiles of rows for the LM head), timed in turn. The crossover
sets native_gemv.AMX_MAX_TOKENS.

    .venv/bin/python -m benchmarks.kernels.bench_bf16_crossover [--tokens 64,128,256,384,512] [--repeats 9]

Prints milliseconds a call (medians of --repeats) per token count. Needs native bf16 products."""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from pdserve.kernels import dequant_tiles, native_gemv, quant_cpu

LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate_up, down
LM_HEAD = (49152, 576)


def _q4_1(rng, rows: int, cols: int) -> tuple:
    q = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    scales = (rng.random((rows, cols // 32), dtype=np.float32) * 0.02).astype(np.float16).view(np.uint16)
    mins = (-rng.random((rows, cols // 32), dtype=np.float32) * 0.01).astype(np.float16).view(np.uint16)
    return native_gemv.matrix_args(4, q, scales, mins, True, 32), (q, scales, mins)


def _ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="64,128,256,384,512", type=lambda s: [int(t) for t in s.split(",")])
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args()
    if not dequant_tiles.native_bf16():
        raise SystemExit("no native bf16 products on this CPU")
    dequant_tiles.set_tile_dtype(torch.bfloat16)
    rng = np.random.default_rng(0)
    layer = [(_q4_1(rng, rows, cols), rows, cols) for rows, cols in LAYER]
    head = quant_cpu.PackedMatrix.of(8, torch.from_numpy(rng.integers(-128, 128, LM_HEAD, dtype=np.int8)),
                                     torch.from_numpy((rng.random((LM_HEAD[0], LM_HEAD[1] // 32)) * 0.02).astype(np.float16)),
                                     None, 32)
    most = native_gemv.AMX_MAX_TOKENS
    print(f"threads {torch.get_num_threads()}\n\n| tokens | layer: compiled | layer: tile + oneDNN "
          "| LM head: compiled | LM head: tiles + oneDNN |\n|---:|---:|---:|---:|---:|")
    for tokens in args.tokens:
        xs = [torch.randn(tokens, cols) for _, _, cols in layer]
        outs = [torch.empty(tokens, rows) for _, rows, _ in layer]
        x_head = torch.randn(tokens, LM_HEAD[1])
        cells: dict[str, list[float]] = {k: [] for k in ("lc", "lo", "hc", "ho")}
        for _ in range(args.repeats):
            cells["lc"].append(_ms(lambda: [native_gemv.run(x.data_ptr(), tokens, cols, m, o.data_ptr())
                                            for ((m, _), _, cols), x, o in zip(layer, xs, outs)]))
            cells["lo"].append(_ms(lambda: [dequant_tiles.bf16_product(x, m, rows, keep_bf16=False)
                                            for ((m, _), rows, _), x in zip(layer, xs)]))
            native_gemv.AMX_MAX_TOKENS = 1 << 20
            cells["hc"].append(_ms(lambda: quant_cpu.packed_matmul(x_head, head)))
            native_gemv.AMX_MAX_TOKENS = 0
            cells["ho"].append(_ms(lambda: quant_cpu.packed_matmul(x_head, head)))
            native_gemv.AMX_MAX_TOKENS = most
        row = " | ".join(f"{statistics.median(cells[k]):.2f}" for k in ("lc", "lo", "hc", "ho"))
        print(f"| {tokens} | {row} |", flush=True)


if __name__ == "__main__":
    main()
