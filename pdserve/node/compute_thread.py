"""The one thread that runs a node's model work: building the engine, its steps, embeddings.

The compiled kernels' OpenMP runtime (libgomp, under numba's "omp" threading layer) keeps one
pool of worker threads per calling thread. A node that built its engine on the main thread (the
kernels' warm-up, the weights' repacking) and then stepped on another thread had two pools, and
its decode steps at two threads took as long as at one: served, SmolLM2's Q4_1 decode step at
one request took 38.8 ms, and 24.8 ms once every parallel call ran on one thread
(benchmarks/peers/bench_vs_llamacpp.py, docs/quantization.md). So everything that runs the model goes
through this one thread.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
_executor: ThreadPoolExecutor | None = None


def compute_executor() -> ThreadPoolExecutor:
    """The process's compute thread (made on first use; it lives as long as the process)."""
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
    return _executor


def on_compute_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs) on the compute thread; its result, or its exception raised here."""
    return compute_executor().submit(fn, *args, **kwargs).result()
