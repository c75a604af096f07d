"""Paged decode attention against the machine's memory speed: SmolLM2's shape (9 query heads, 3
KV heads of 64) at --requests x --context tokens, each request's blocks scattered over a pool that
holds --layers layers per block (the engine's block-major layout), in float32 and bf16 caches.
Each call sweeps every layer in turn, as a decode step does, so the rows come from memory, not
from the last call's cache (one layer timed alone stayed in L3 at small contexts); ms is per layer. Beside it the kernels it replaced: numba's (float32) and, over bf16, the gather
and widen to float32 then numba's (fp8_kv's path for mixed steps before native_paged).

    .venv/bin/python -m benchmarks.kernels.bench_decode_attention [--requests 32 128] [--context 1024 2048 4096]

GB/s counts the K and V bytes the rows read once; "of memory" divides it by a streaming read of
a 1 GiB buffer on the same threads (torch's sum), timed in the same repeat. Medians of --repeats.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.kernels.bench_cpu_layer_ops import median_us
from pdserve.assembly.pool_pages import zeroed_pool
from pdserve.kernels import native_paged, numba_ops
from pdserve.kernels.fp8_kv import _compact_blocks

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def _cache(requests: int, context: int, layers: int, dtype: torch.dtype, seed: int):
    """([(K plane, V plane)] of each layer of a block-major pool, tables, lens, pool), blocks shuffled."""
    per = -(-context // BLOCK)
    blocks = requests * per
    g = torch.Generator().manual_seed(seed)
    pool = zeroed_pool((blocks, layers, 2, BLOCK, KV_HEADS, HEAD_DIM), dtype, torch.device("cpu"))  # as the engine's
    for block in range(0, blocks, 256):  # in parts: no float32 copy of a whole bf16 pool
        part = pool[block:block + 256]
        part.copy_(torch.randn(part.shape, generator=g))
    tables = torch.randperm(blocks, generator=g).view(requests, per).int()
    lens = torch.full((requests,), context, dtype=torch.int32)
    return [(pool[:, layer, 0], pool[:, layer, 1]) for layer in range(layers)], tables, lens, pool


def _median_s(fn, calls: int) -> float:
    return median_us(fn, calls) / 1e6


def _memory_gbs(buffer: torch.Tensor) -> float:
    return buffer.numel() * buffer.element_size() / _median_s(buffer.sum, 5) / 1e9


def _kernels(dtype: torch.dtype, planes, tables, lens, q):
    """(name, a sweep of the kernel over every layer's planes)"""
    def sweep(kernel):
        return lambda: [kernel(k, v) for k, v in planes]

    native = ("compiled", sweep(lambda k, v: native_paged.paged_decode_attention(q, k, v, tables, lens, 0.125)))
    if dtype == torch.float32:
        return [native, ("numba", sweep(lambda k, v: numba_ops.numba_decode_attention(q, k, v, tables, lens, 0.125)))]

    def gather_widen(k, v):  # a mixed step's decode rows before native_paged: compact, widen, numba's kernel
        kk, vv, local = _compact_blocks(k, v, tables, (1.0, 1.0), torch.float32)
        return numba_ops.numba_decode_attention(q, kk, vv, local, lens, 0.125)
    return [native, ("gather + widen + numba", sweep(gather_widen))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--context", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--layers", type=int, default=16, help="a pool past the L3 cache at every size")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(f"threads {torch.get_num_threads()}\n")
    print("| cache | requests | context | kernel | ms | GB/s | of memory |\n|---|---:|---:|---|---:|---:|---:|")
    for dtype in (torch.bfloat16, torch.float32):
        for requests in args.requests:
            for context in args.context:
                planes, tables, lens, pool = _cache(requests, context, args.layers, dtype, seed=requests + context)
                # after the pool: with this 1 GiB allocated first, the same sweep took twice as long
                # on the Zen 4 VM (8.4 against 16.3 ms; where the hypervisor placed the pool)
                stream = torch.ones(2**28)
                q = torch.randn(requests, HEADS, HEAD_DIM)
                nbytes = requests * context * KV_HEADS * HEAD_DIM * 2 * pool.element_size()
                runs: dict[str, list[tuple[float, float]]] = {}
                for _ in range(args.repeats):
                    memory = _memory_gbs(stream)
                    for name, fn in _kernels(dtype, planes, tables, lens, q):
                        runs.setdefault(name, []).append((_median_s(fn, 3) / args.layers, memory))
                for name, rs in runs.items():
                    s = statistics.median(r[0] for r in rs)
                    mem = statistics.median(r[1] for r in rs)
                    gbs = nbytes / s / 1e9
                    print(f"| {str(dtype)[6:]} | {requests} | {context} | {name} | {s * 1e3:.1f} | {gbs:.1f} | "
                          f"{gbs / mem:.2f} |", flush=True)
                del pool, planes, stream


if __name__ == "__main__":
    main()
