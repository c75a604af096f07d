"""A step's model inputs, built on the host with numpy: token ids, positions, KV slots, context
lengths and block tables for every scheduled request.

Why numpy: with hundreds of running requests, a tensor per request (and one host-to-device copy
per tensor) cost more than the GPU's whole decode step. Here the decode rows are filled with a
handful of vectorised operations, and the runner ships the result in two copies.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from pdserve.engine.request import Request


def fill_decode_rows(reqs: list[Request], block_size: int, ints64: np.ndarray,
                     context_lens: np.ndarray, tables: np.ndarray,
                     kept_rows: KeptTableRows | None = None) -> None:
    """Inputs of n one-token queries into the first n rows/columns of preallocated arrays:
    ints64 [3, >=n] (token id, position, slot), context_lens [>=n], tables [>=n, width].
    Table entries past a request's own blocks keep whatever they held: no kernel reads them.
    kept_rows: block-table rows carried over from the previous step (only new blocks written)."""
    n = len(reqs)
    pos = np.fromiter((r.num_computed_tokens for r in reqs), np.int64, n)
    ints64[0, :n] = np.fromiter((r.all_token_ids[r.num_computed_tokens] for r in reqs), np.int64, n)
    ints64[1, :n] = pos
    rows = tables[:n]
    if kept_rows is not None:
        kept_rows.fill(reqs, rows)
    else:
        counts = np.fromiter((len(r.block_ids) for r in reqs), np.int64, n)
        flat = np.fromiter(itertools.chain.from_iterable(r.block_ids for r in reqs), np.int32,
                           int(counts.sum()))
        rows[np.arange(tables.shape[1])[None, :] < counts[:, None]] = flat  # row-major: in order
    current_block = rows[np.arange(n), pos // block_size].astype(np.int64)
    ints64[2, :n] = current_block * block_size + pos % block_size
    context_lens[:n] = pos + 1


class KeptTableRows:
    """Block-table rows kept from one pure-decode step to the next, so a step writes only the
    blocks appended since (at 256 sequences, rebuilding every row cost most of the host time of
    the step's inputs).

    A kept row is trusted only while the request holds the very list object it was read from:
    running requests only extend their block list, and KVCacheManager.free (preemption, finish)
    replaces it with a new one, after which the row is written whole again. (KVCacheManager.slide
    overwrites leading entries in place with SLID_OUT; the row keeps their old ids, which no
    kernel reads: they are out of the window.)"""

    def __init__(self, capacity: int, width: int):
        self.rows = np.zeros((capacity, width), np.int32)
        # request id: (its block list object, row, blocks written, last step used)
        self.entries: dict[str, tuple[list[int], int, int, int]] = {}
        self.free = list(range(capacity))
        self.step = 0

    def fill(self, reqs: list[Request], out: np.ndarray) -> None:
        """out [n, >= widest block list]: each request's block table row."""
        self.step += 1
        step, rows, entries = self.step, self.rows, self.entries
        picks = np.empty(len(reqs), np.int64)
        width = 0
        for i, req in enumerate(reqs):
            blocks = req.block_ids
            count = len(blocks)
            kept = entries.get(req.request_id)
            if kept is not None and kept[0] is blocks and kept[2] <= count:
                row = kept[1]
                if kept[2] < count:
                    rows[row, kept[2]:count] = blocks[kept[2]:count]
            else:
                row = kept[1] if kept is not None else self._free_row()
                rows[row, :count] = blocks
            entries[req.request_id] = (blocks, row, count, step)
            picks[i] = row
            width = max(width, count)
        out[:, :width] = rows[picks, :width]

    def _free_row(self) -> int:
        if not self.free:  # drop every entry this step has not used (yet)
            stale = [rid for rid, e in self.entries.items() if e[3] != self.step]
            for rid in stale:
                self.free.append(self.entries.pop(rid)[1])
        return self.free.pop()


@dataclass
class StepInputs:
    ints64: np.ndarray           # [3, T]: token ids, positions, slots
    decode_context_lens: np.ndarray   # [D] int32
    decode_tables: np.ndarray         # [D, width] int32
    prefill_cu_seqlens: np.ndarray    # [P+1] int32
    prefill_context_lens: np.ndarray  # [P] int32
    prefill_tables: np.ndarray        # [P, width] int32
    sample_rows: list[int]
    to_sample: list[Request]
    num_decode_tokens: int = 0        # rows that run as one-token decodes (the first ones)

    def ints32(self) -> np.ndarray:
        """Every int32 input in one flat array (one copy to the device); see split_ints32."""
        return np.concatenate([self.decode_context_lens, self.decode_tables.ravel(),
                               self.prefill_cu_seqlens, self.prefill_context_lens,
                               self.prefill_tables.ravel()])

    def int32_shapes(self) -> list[tuple[int, ...]]:
        return [a.shape for a in (self.decode_context_lens, self.decode_tables,
                                  self.prefill_cu_seqlens, self.prefill_context_lens,
                                  self.prefill_tables)]


def is_decode_query(req: Request, n: int) -> bool:
    """A query of decode shape: one token, or one token plus the request's drafts. Each of its
    tokens attends to the whole context up to itself, so each runs as a one-token decode row
    (its own context length, the request's block table) beside the plain decodes: one paged
    decode kernel call per layer, no per-request causal prefill pass."""
    return n == 1 or (bool(req.spec_token_ids) and n == 1 + len(req.spec_token_ids))


def fill_drafted_rows(items: list[tuple[Request, int]], block_size: int, ints64: np.ndarray,
                      context_lens: np.ndarray, tables: np.ndarray) -> None:
    """As fill_decode_rows, for queries of several tokens (a request's last token and its
    drafts): one decode row per token, at consecutive positions, with the request's table."""
    counts = np.fromiter((n for _, n in items), np.int64, len(items))
    total = int(counts.sum())
    owner = np.repeat(np.arange(len(items)), counts)
    first_row = np.cumsum(counts) - counts
    pos = np.repeat(np.fromiter((r.num_computed_tokens for r, _ in items), np.int64, len(items)), counts)
    pos += np.arange(total) - first_row[owner]
    ints64[0, :total] = np.fromiter(itertools.chain.from_iterable(
        r.all_token_ids[r.num_computed_tokens:r.num_computed_tokens + n] for r, n in items), np.int64, total)
    ints64[1, :total] = pos
    per_request = np.zeros((len(items), tables.shape[1]), np.int32)
    nblocks = np.fromiter((len(r.block_ids) for r, _ in items), np.int64, len(items))
    per_request[np.arange(tables.shape[1])[None, :] < nblocks[:, None]] = np.fromiter(
        itertools.chain.from_iterable(r.block_ids for r, _ in items), np.int32, int(nblocks.sum()))
    tables[:total] = per_request[owner]
    ints64[2, :total] = tables[np.arange(total), pos // block_size].astype(np.int64) * block_size + pos % block_size
    context_lens[:total] = pos + 1


def build_step_inputs(items: list[tuple[Request, int]], num_decodes: int,
                      block_size: int) -> StepInputs:
    """items: (request, new tokens), the num_decodes decode-shaped queries (is_decode_query)
    first; their tokens are the step's first num_decode_tokens rows, one decode row each."""
    decodes = items[:num_decodes]
    prefills = items[num_decodes:]
    num_decode_tokens = sum(n for _, n in decodes)
    total = num_decode_tokens + sum(n for _, n in prefills)
    ints64 = np.empty((3, total), np.int64)
    decode_ctx = np.empty(num_decode_tokens, np.int32)
    decode_tables = np.zeros((num_decode_tokens, _width([r for r, _ in decodes])), np.int32)
    if num_decode_tokens == num_decodes > 0:
        fill_decode_rows([r for r, _ in decodes], block_size, ints64, decode_ctx, decode_tables)
    elif decodes:
        fill_drafted_rows(decodes, block_size, ints64, decode_ctx, decode_tables)
    cu = np.zeros(len(prefills) + 1, np.int32)
    prefill_ctx = np.empty(len(prefills), np.int32)
    prefill_tables = np.zeros((len(prefills), _width([r for r, _ in prefills])), np.int32)
    row = num_decode_tokens
    for i, (req, n) in enumerate(prefills):
        start = req.num_computed_tokens
        pos = np.arange(start, start + n, dtype=np.int64)
        blocks = np.asarray(req.block_ids, dtype=np.int64)
        ints64[0, row:row + n] = req.all_token_ids[start:start + n]
        ints64[1, row:row + n] = pos
        ints64[2, row:row + n] = blocks[pos // block_size] * block_size + pos % block_size
        prefill_tables[i, :len(blocks)] = blocks
        prefill_ctx[i] = start + n
        row += n
        cu[i + 1] = row - num_decode_tokens
    sample_rows, to_sample, row = [], [], 0
    for req, n in items:
        row += n
        if req.num_computed_tokens + n == req.num_tokens:
            sample_rows.extend(range(row - 1 - len(req.spec_token_ids), row))  # drafts: every row
            to_sample.append(req)
    return StepInputs(ints64, decode_ctx, decode_tables, cu, prefill_ctx, prefill_tables,
                      sample_rows, to_sample, num_decode_tokens)


def _width(reqs: list[Request]) -> int:
    return max((len(r.block_ids) for r in reqs), default=1)
