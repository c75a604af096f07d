"""Production traces in Mooncake's JSONL format, turned into prompts a server can be sent.

Each line is one request: {"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [...]}. A hash id names one 512-token block of the prompt, chained like block keys:
two requests whose leading hash ids agree share that prefix. Mooncake's FAST'25 traces
(kvcache-ai/Mooncake, FAST25-release/traces/) are in this format; benchmarks/traces/ holds a
300-line slice of each for tests.

A prompt is built from its hash ids alone: each block's tokens are drawn from a generator seeded
by (seed, hash id), so equal ids give equal tokens in every process, and the prompts (and the
cache bounds of pdserve.loadgen.cache_bound) do not depend on what the server answers.
"""
from __future__ import annotations

import functools
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512  # the tokens one Mooncake hash id names
MIN_SHARED_BLOCKS = 2  # leading blocks a turn shares with the one it continues


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class TraceScale:
    """How a trace is shrunk to a machine: lengths divided (a block becomes 512 / divisor
    tokens), outputs divided and capped, time stretched or squeezed, and a window of it kept."""

    length_divisor: int = 1
    output_divisor: int = 1
    output_cap: int | None = None
    time_scale: float = 1.0
    start_s: float = 0.0
    duration_s: float | None = None
    max_requests: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.length_divisor <= TRACE_BLOCK_TOKENS or TRACE_BLOCK_TOKENS % self.length_divisor:
            raise ValueError(f"the length divisor must divide {TRACE_BLOCK_TOKENS}, got {self.length_divisor}")
        if self.output_divisor < 1 or (self.output_cap is not None and self.output_cap < 1):
            raise ValueError("the output divisor and cap must be at least 1")
        if self.time_scale < 0:
            raise ValueError("the time scale must not be negative")

    @property
    def block_tokens(self) -> int:
        return TRACE_BLOCK_TOKENS // self.length_divisor

    def input_len(self, req: TraceRequest) -> int:
        return max(1, math.ceil(req.input_length / self.length_divisor))

    def output_len(self, req: TraceRequest) -> int:
        n = max(1, math.ceil(req.output_length / self.output_divisor))
        return min(n, self.output_cap) if self.output_cap else n

    def select(self, requests: list[TraceRequest]) -> list[TraceRequest]:
        """The requests in the window, in time order, at most max_requests of them."""
        ordered = sorted(requests, key=lambda r: r.timestamp_ms)
        t0 = ordered[0].timestamp_ms if ordered else 0.0
        start = t0 + self.start_s * 1000
        end = math.inf if self.duration_s is None else start + self.duration_s * 1000
        kept = [r for r in ordered if start <= r.timestamp_ms < end]
        return kept[:self.max_requests] if self.max_requests is not None else kept


def read_trace(path: str | Path) -> list[TraceRequest]:
    """The trace's requests; a malformed line is a ValueError naming the file and line."""
    requests = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                requests.append(_parse_line(line, f"{path}:{number}"))
    if not requests:
        raise ValueError(f"{path}: no requests in the trace")
    return requests


def _parse_line(line: str, where: str) -> TraceRequest:
    try:
        row = json.loads(line)
        req = TraceRequest(float(row["timestamp"]), int(row["input_length"]), int(row["output_length"]),
                           tuple(int(h) for h in row["hash_ids"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{where}: not a trace line ({type(exc).__name__}: {exc})") from None
    if req.input_length < 1 or req.output_length < 0 or req.timestamp_ms < 0:
        raise ValueError(f"{where}: lengths and the timestamp must not be negative (input at least 1)")
    return req


@functools.lru_cache(maxsize=65536)
def block_token_ids(hash_id: int, seed: int, block_tokens: int, low: int, high: int) -> tuple[int, ...]:
    """The tokens of one trace block: the same for the same id in every process (random.Random
    seeded by a string hashes it with SHA-512, not Python's per-process hash)."""
    rng = random.Random(f"trace-block:{seed}:{hash_id}")
    return tuple(rng.randrange(low, high) for _ in range(block_tokens))


def prompt_token_ids(req: TraceRequest, scale: TraceScale, seed: int, low: int, high: int,
                     index: int = 0) -> list[int]:
    """The request's prompt: its hash ids' blocks in order, cut to its scaled input length. A
    prompt longer than its ids cover (rounding) is padded with tokens of its own (by index)."""
    n, b = scale.input_len(req), scale.block_tokens
    tokens: list[int] = []
    for hash_id in req.hash_ids[:math.ceil(n / b)]:
        tokens += block_token_ids(hash_id, seed, b, low, high)
    if len(tokens) < n:
        rng = random.Random(f"trace-pad:{seed}:{index}")
        tokens += [rng.randrange(low, high) for _ in range(n - len(tokens))]
    return tokens[:n]


def full_block_keys(req: TraceRequest, scale: TraceScale) -> list[int]:
    """The hash ids of the scaled prompt's full blocks: the units a prefix cache can serve."""
    return list(req.hash_ids[:scale.input_len(req) // scale.block_tokens])


def conversations(requests: list[TraceRequest]) -> list[list[int]]:
    """Indices of the requests grouped into conversations, each in time order. A request
    continues an earlier one when that one's full blocks are its leading blocks (a later turn
    resends the history, and the earlier turn's last block was partial); it continues the
    latest such turn that no other request continued yet. At least MIN_SHARED_BLOCKS must agree:
    one block is what unrelated requests share when they open with the same system prompt."""
    open_ends: dict[tuple[int, ...], int] = {}  # a turn's full blocks -> its conversation
    groups: list[list[int]] = []
    for i in sorted(range(len(requests)), key=lambda k: requests[k].timestamp_ms):
        ids = requests[i].hash_ids
        conv = next((open_ends.pop(ids[:k]) for k in range(len(ids) - 1, MIN_SHARED_BLOCKS - 1, -1)
                     if ids[:k] in open_ends), None)
        if conv is None:
            conv = len(groups)
            groups.append([])
        groups[conv].append(i)
        if len(ids) > MIN_SHARED_BLOCKS:
            open_ends[ids[:-1]] = conv
    return groups
