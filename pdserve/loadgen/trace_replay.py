"""Replaying a trace (pdserve.loadgen.trace) against a server, and the cache bounds of that replay.

Two ways to replay:
- open loop: each request is sent at its own timestamp (times the time scale), whatever the
  server's pace;
- sessions: the trace's conversations, sampled (--num-prompts of them, seeded) and started at
  --request-rate (Poisson) or at their first turn's time; each next turn is sent a think time
  after the previous answer, the think time being the turns' gap in the trace, scaled.
The cache bounds take the replayed requests in trace order.
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tqdm.asyncio import tqdm

from pdserve.loadgen.cache_bound import BlockRequest, infinite_cache_share, optimal_cache_share
from pdserve.loadgen.metrics import RequestResult
from pdserve.loadgen.trace import TraceRequest, TraceScale, conversations, full_block_keys, prompt_token_ids, read_trace

SendFn = Callable[[list[int], int], Awaitable[RequestResult]]  # (prompt ids, max tokens) -> result


@dataclass
class ReplayPlan:
    requests: list[TraceRequest]        # in trace order
    prompts: list[list[int]]
    output_lens: list[int]
    sessions: list[list[int]] | None    # indices into requests, or None for open loop
    scale: TraceScale

    def cache_bounds(self, capacity_tokens: int | None) -> dict[str, float]:
        blocks = [BlockRequest(tuple(full_block_keys(r, self.scale)), len(p))
                  for r, p in zip(self.requests, self.prompts)]
        bounds = {"cache_bound_infinite": infinite_cache_share(blocks, self.scale.block_tokens)}
        if capacity_tokens is not None:
            bounds["cache_bound_optimal"] = optimal_cache_share(blocks, self.scale.block_tokens, capacity_tokens)
        return bounds


def plan_replay(path: str, scale: TraceScale, seed: int, low: int, high: int,
                sessions: bool = False, num_sessions: int | None = None) -> ReplayPlan:
    """The prompts and schedule of a replay, made before anything is sent."""
    requests = scale.select(read_trace(path))
    groups = None
    if sessions:
        groups = conversations(requests)
        if num_sessions is not None and num_sessions < len(groups):
            groups = sorted(random.Random(seed).sample(groups, num_sessions), key=lambda g: g[0])
        kept = sorted(i for g in groups for i in g)
        renumber = {old: new for new, old in enumerate(kept)}
        requests = [requests[i] for i in kept]
        groups = [[renumber[i] for i in g] for g in groups]
    prompts = [prompt_token_ids(r, scale, seed, low, high, i) for i, r in enumerate(requests)]
    return ReplayPlan(requests, prompts, [scale.output_len(r) for r in requests], groups, scale)


async def run_replay(plan: ReplayPlan, send: SendFn, request_rate: float, seed: int,
                     on_result: Callable[[RequestResult], None]) -> list[RequestResult]:
    results: list[RequestResult] = []

    async def one(i: int) -> None:
        result = await send(plan.prompts[i], plan.output_lens[i])
        results.append(result)
        on_result(result)

    if plan.sessions is None:
        await _open_loop(plan, one)
    else:
        await _sessions(plan, one, request_rate, seed)
    return results


async def replay_trace(cfg, send: SendFn) -> tuple[list[RequestResult], float, dict]:
    """cfg: the load generator's BenchConfig (its trace fields, seed, token range and rate).
    The cache bounds come from the plan, before anything is sent."""
    scale = cfg.trace_scale
    plan = plan_replay(cfg.trace, scale, cfg.seed, cfg.min_token_id, cfg.max_token_id,
                       cfg.trace_sessions, cfg.trace_num_sessions)
    bounds = plan.cache_bounds(cfg.cache_capacity_tokens)
    pbar = None if cfg.disable_tqdm else tqdm(total=len(plan.requests), desc="trace")
    start = time.perf_counter()
    results = await run_replay(plan, send, cfg.request_rate, cfg.seed,
                               lambda _: pbar.update(1) if pbar is not None else None)
    duration = time.perf_counter() - start
    if pbar is not None:
        pbar.close()
    return results, duration, {"trace_requests": len(plan.requests), "trace_block_tokens": scale.block_tokens,
                               **bounds}


async def _at(start: float, offset_s: float) -> None:
    await asyncio.sleep(max(0.0, start + offset_s - time.perf_counter()))


async def _open_loop(plan: ReplayPlan, one: Callable[[int], Awaitable[None]]) -> None:
    t0, start = plan.requests[0].timestamp_ms, time.perf_counter()
    tasks = []
    for i, req in enumerate(plan.requests):
        await _at(start, (req.timestamp_ms - t0) / 1000 * plan.scale.time_scale)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)


async def _sessions(plan: ReplayPlan, one: Callable[[int], Awaitable[None]], request_rate: float,
                    seed: int) -> None:
    assert plan.sessions is not None
    t0, start = plan.requests[0].timestamp_ms, time.perf_counter()
    arrivals, offset = random.Random(seed + 1), 0.0
    tasks = []
    for turns in plan.sessions:
        if math.isfinite(request_rate) and request_rate > 0:
            await _at(start, offset)
            offset += arrivals.expovariate(request_rate)
        else:
            await _at(start, (plan.requests[turns[0]].timestamp_ms - t0) / 1000 * plan.scale.time_scale)
        tasks.append(asyncio.create_task(_conversation(plan, turns, one)))
    await asyncio.gather(*tasks)


async def _conversation(plan: ReplayPlan, turns: list[int], one: Callable[[int], Awaitable[None]]) -> None:
    for k, i in enumerate(turns):
        if k:
            gap_ms = plan.requests[i].timestamp_ms - plan.requests[turns[k - 1]].timestamp_ms
            await asyncio.sleep(gap_ms / 1000 * plan.scale.time_scale)
        await one(i)
