"""CUDA graphs for pure-decode steps (the shape of vLLM's CUDAGraphRunner and nano-vllm's
capture_cudagraph).

A decode step of a small model is a few hundred short kernels; launched one by one from Python
the step is bound by the launches, not by the GPU. Here each batch-size bucket's whole forward
(embedding, every layer, final norm, lm_head) is captured once into a graph over static input
buffers; a step copies its inputs into the buffers' first rows, pads the rest of the bucket
(slot -1: nothing stored; context 0: nothing read) and replays the graph.

Only kernels whose launch does not depend on the inputs' values may be captured: the kernel
module says so with CUDA_GRAPH_SAFE (Triton's attention reads lengths on the device; the torch
ops read them on the host).
"""
from __future__ import annotations

import logging

import torch

from pdserve.engine.overlap import take_pending

log = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """Captured batch sizes: powers of two up to 16, then every multiple of 16 (padding a step
    to its bucket wastes at most 15 rows of GEMM work, which is bandwidth-free at these sizes)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch + 1, 16))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    """One captured graph per bucket; all share one memory pool and one set of input buffers.

    The inputs live in pinned host arrays that mirror the device buffers, so a step is: fill the
    host rows with numpy, two asynchronous copies, one replay."""

    def __init__(self, model, make_context, device: torch.device, max_batch: int, max_blocks: int):
        self.model, self.make_context = model, make_context
        self.buckets = batch_buckets(max_batch)
        self.max_batch, self.max_blocks = max_batch, max_blocks
        # ints64 rows: token ids, positions, slots. ints32: context lengths, then block tables.
        self.host64 = torch.zeros(3, max_batch, dtype=torch.int64).pin_memory()
        self.host32 = torch.zeros(max_batch * (1 + max_blocks), dtype=torch.int32).pin_memory()
        self.dev64 = self.host64.to(device)
        self.dev32 = self.host32.to(device)
        self.np64, self.np32 = self.host64.numpy(), self.host32.numpy()
        self.np64[2] = -1  # slot -1: store nothing
        # Async scheduling: per row, the row of the step before's device tokens to read, or -1.
        self.host_src = torch.full((max_batch,), -1, dtype=torch.int64).pin_memory()
        self.dev_src = self.host_src.to(device)
        self.copied = torch.cuda.Event()  # the host buffers may be refilled once this has passed
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None  # [max_batch, vocab], written by every graph

    def bucket_for(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    def host_views(self):
        """(ints64 [3, max_batch], context_lens [max_batch], tables [max_batch, max_blocks]) to
        fill before replay(); numpy views of the pinned buffers."""
        self.copied.synchronize()
        m = self.max_batch
        return self.np64, self.np32[:m], self.np32[m:].reshape(m, self.max_blocks)

    def host_sources(self, n: int):
        """The first n rows of the pinned source buffer (after host_views has waited)."""
        return self.host_src.numpy()[:n]

    def _device_views(self, b: int):
        m = self.max_batch
        tables = self.dev32[m:].view(m, self.max_blocks)
        return self.dev64[0, :b], self.dev64[1, :b], self.dev64[2, :b], self.dev32[:b], tables[:b]

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest bucket first, so the smaller graphs fit in the pool the first one sized."""
        pool = None
        for b in reversed(self.buckets):
            self._forward(b)  # warm-up outside capture: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self._forward(b)
            pool = pool or graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def _forward(self, b: int) -> None:
        token_ids, positions, slots, context_lens, tables = self._device_views(b)
        hidden = self.model(token_ids, positions, self.make_context(slots, tables, context_lens))
        logits = self.model.compute_logits(hidden)
        if self.logits is None:
            self.logits = torch.empty(self.max_batch, logits.shape[-1], dtype=logits.dtype,
                                      device=logits.device)
        self.logits[:b].copy_(logits)

    def replay(self, n: int, previous: torch.Tensor | None = None, sources=None) -> torch.Tensor:
        """Runs the first n rows of the host buffers (filled through host_views); returns
        logits [n, vocab]. Rows n.. up to the bucket are made padding: store and read nothing.
        previous: the step before's device tokens, read where host_sources says (async
        scheduling); the copy runs on the stream, ahead of the graph."""
        b = self.bucket_for(n)
        m = self.max_batch
        self.np64[0, n:b] = 0  # a stale row may hold a pending token's -1: embed a real id
        self.np64[2, n:b] = -1
        self.np32[n:b] = 0
        self.dev64.copy_(self.host64, non_blocking=True)
        self.dev32[:b].copy_(self.host32[:b], non_blocking=True)
        self.dev32[m:m + b * self.max_blocks].copy_(self.host32[m:m + b * self.max_blocks],
                                                    non_blocking=True)
        if previous is not None:
            self.dev_src[:n].copy_(self.host_src[:n], non_blocking=True)
            ids = self.dev64[0, :n]
            ids.copy_(take_pending(ids, previous, self.dev_src[:n]))
        self.copied.record()
        self.graphs[b].replay()
        return self.logits[:n]
