"""The compiled kernel's products by setting (pdserve/kernels/native_gemv*.c): float32, bf16 and
int8 (native_gemv_int8.c; on a CPU with AMX, AMX's int8 tiles from native_gemv_int8_amx.c's
pd_int8_amx_min_tokens and bf16 tiles past INT8_MAX_ROWS_AMX rows, and `int8-vnni`: VNNI at every
row count), the int8 products read from each matrix's int8 pack as a layer's are, beside torch's bf16 matmul
(oneDNN) over weights dequantized once, on SmolLM2-135M's four Q4_1 layer matrices (qkv, o,
gate_up, down), from one token to a prefill.

    .venv/bin/python -m benchmarks.kernels.bench_int8_gemm [--tokens 1,2,8,16,32,128,512,2048] \
        [--threads 1] [--repeats 5]

Prints, per token count, the median over --repeats of a layer's four products (milliseconds) for
each setting, int8's rate (GOP/s: 2 x rows x columns x tokens) and its speed-up over the fastest
of the others. The settings are timed in turn within each repeat. bf16 needs AVX-512 BF16 or AMX,
int8 AVX-512 VNNI; a setting the CPU lacks is left out. oneDNN runs from 16 tokens (below, its
fixed cost is not what anyone would run)."""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from pdserve.kernels import dequant_tiles, native_gemv

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate_up, down


def _matrices(rng) -> list[tuple[tuple, int, int, torch.Tensor]]:
    out = []
    for rows, cols in SHAPES:
        q = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
        scales = (rng.random((rows, cols // 32), dtype=np.float32) * 0.02).astype(np.float16).view(np.uint16)
        mins = (-rng.random((rows, cols // 32), dtype=np.float32) * 0.01).astype(np.float16).view(np.uint16)
        dense = torch.randn(rows, cols).bfloat16()  # oneDNN's operand (its values do not change its speed)
        args = native_gemv.matrix_args(4, q, scales, mins, True, 32)
        pack = native_gemv.int8_pack(args, cols)  # as a layer's PackedMatrix holds it under int8
        out.append((native_gemv.with_int8_pack(args, pack), rows, cols, dense, pack))
    return out


def _compiled(matrices, xs, outs, tokens: int) -> None:
    for (matrix, _, cols, *_), x, out in zip(matrices, xs, outs):
        assert native_gemv.run(x.ctypes.data, tokens, cols, matrix, out.ctypes.data)


def _onednn(matrices, xs) -> None:
    for (_, _, _, dense, _), x in zip(matrices, xs):
        torch.nn.functional.linear(torch.from_numpy(x).bfloat16(), dense).float()


def _time(fn, calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _settings() -> list[str]:
    names = ["float32"]
    names += ["bfloat16"] if dequant_tiles.native_bf16() else []
    names += ["int8"] if dequant_tiles.native_int8() else []
    names += ["int8-vnni"] if dequant_tiles.native_int8() and dequant_tiles.native_amx() else []
    return names


AMX_INT8_FROM = native_gemv.set_int8_amx_min_tokens(None)  # the library's own


def _set(name: str) -> None:
    """The products of setting `name` for this process (int8-vnni: int8 without AMX's tiles)."""
    crossover, vnni = dequant_tiles.INT8_MAX_ROWS_AMX, name == "int8-vnni"
    if vnni:
        dequant_tiles.INT8_MAX_ROWS_AMX = None
    dequant_tiles.set_tile_dtype(getattr(torch, name.removesuffix("-vnni")))
    dequant_tiles.INT8_MAX_ROWS_AMX = crossover
    native_gemv.set_int8_amx_min_tokens(1 << 30 if vnni else AMX_INT8_FROM)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,2,8,16,32,128,512,2048", type=lambda s: [int(t) for t in s.split(",")])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import numba  # heavy: the compiled kernel takes numba's thread count
    numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    matrices = _matrices(rng)
    flops = 2 * sum(rows * cols for rows, cols in SHAPES)
    settings = _settings()
    print(f"| tokens | {' | '.join(settings)} | oneDNN bf16 | int8 GOP/s | int8 speed-up |")
    print("|---:|" + "---:|" * (len(settings) + 3))
    for tokens in args.tokens:
        xs = [rng.standard_normal((tokens, cols), dtype=np.float32) for _, _, cols, *_ in matrices]
        outs = [np.empty((tokens, rows), np.float32) for _, rows, *_ in matrices]
        calls = max(1, 2000 // tokens)
        runs: dict[str, list[float]] = {name: [] for name in [*settings, "oneDNN"]}
        for _ in range(args.repeats):
            for name in settings:
                _set(name)
                runs[name].append(_time(lambda: _compiled(matrices, xs, outs, tokens), calls))
            if tokens >= 16:
                runs["oneDNN"].append(_time(lambda: _onednn(matrices, xs), calls))
        ms = {name: statistics.median(t) * 1e3 if t else float("nan") for name, t in runs.items()}
        others = [v for name, v in ms.items() if name != "int8" and v == v]
        cells = " | ".join(f"{ms[name]:.3f}" for name in [*settings, "oneDNN"])
        rate = f"{flops * tokens / ms['int8'] / 1e6:.0f} | {min(others) / ms['int8']:.2f}x" if "int8" in ms else "|"
        print(f"| {tokens} | {cells} | {rate} |")
    dequant_tiles.set_tile_dtype(torch.float32)


if __name__ == "__main__":
    main()
