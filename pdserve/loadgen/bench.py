"""Load generator for any OpenAI-compatible server (streams /v1/completions: pdserve.loadgen.client).

Workloads:
  random         num_prompts prompts, lengths uniform in [input_len_min, input_len_max].
  shared-prefix  num_groups x prompts_per_group prompts; each group shares a prefix_len-token
                 prefix followed by a question_len-token question (order shuffled).
  multi-round    num_users users x num_rounds rounds; each round sends the whole history
                 (earlier questions and answers) plus a new question. Rounds of one user are
                 sequential; users run concurrently.
  trace          --trace FILE: a production trace in Mooncake's JSONL format, replayed open loop
                 or as conversations (pdserve.loadgen.trace_replay), with the cache bounds.
Load: --concurrency caps requests in flight; --request-rate spaces arrivals (of sessions:
one request each, or one user for multi-round) as a Poisson process. Both may be combined.
Prompts are token-id lists by default (exact lengths); --prompt-mode text sends random words.
Requests set ignore_eos and a fixed max_tokens so every request generates output_len tokens.

    python -m benchmarks.serving.serve_bench --base-url http://127.0.0.1:8000 --workload random \
        --num-prompts 200 --concurrency 16 --output-json out.json
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import aiohttp
from tqdm.asyncio import tqdm

from pdserve.loadgen.client import Client, first_model, scrape_router_stages, stream_completion
from pdserve.loadgen.metrics import RequestResult, compute_metrics, latency_samples
from pdserve.loadgen.stages import stage_breakdown
from pdserve.loadgen.trace import TraceScale
from pdserve.loadgen.trace_replay import replay_trace

logger = logging.getLogger(__name__)

Prompt = list[int] | str
WORKLOADS = ("random", "shared-prefix", "multi-round", "trace")
_WORDS = ("the of and to in is was for on that with as by at from his an were are which this "
          "be or has had first one their its new after but who not they have her she two been "
          "other when there all during into school time may years more most only over city "
          "some world would where later up such used many can state about national out known "
          "university united then made").split()


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first model the server lists
    workload: str = "random"
    num_prompts: int = 100
    input_len_min: int = 128
    input_len_max: int = 512
    output_len: int = 128
    num_groups: int = 4
    prompts_per_group: int = 16
    prefix_len: int = 1024
    question_len: int = 32
    num_users: int = 8
    num_rounds: int = 4
    prompt_mode: str = "token-ids"  # token-ids | text
    min_token_id: int = 100  # random ids avoid the low (often special/byte) ids
    max_token_id: int = 30000  # exclusive
    concurrency: int | None = None
    request_rate: float = math.inf
    num_warmup: int = 2
    seed: int = 0
    temperature: float = 0.0
    goodput_ttft_ms: float | None = None
    goodput_tpot_ms: float | None = None
    timeout_s: float = 600.0
    api_key: str | None = None
    output_json: str | None = None
    disable_tqdm: bool = False
    trace: str | None = None
    trace_scale: TraceScale = field(default_factory=TraceScale)  # flags --trace-length-divisor etc.
    trace_sessions: bool = False
    trace_num_sessions: int | None = None
    cache_capacity_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.trace_scale, dict):  # a saved report's config
            self.trace_scale = TraceScale(**self.trace_scale)
        if self.trace is not None:
            self.workload = "trace"
        elif self.workload == "trace":
            raise ValueError("the trace workload needs --trace FILE")
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.workload!r}")
        if self.prompt_mode not in ("token-ids", "text"):
            raise ValueError(f"prompt_mode must be token-ids or text, got {self.prompt_mode!r}")
        if not 1 <= self.input_len_min <= self.input_len_max:
            raise ValueError("need 1 <= input_len_min <= input_len_max")
        if not 0 <= self.min_token_id < self.max_token_id:
            raise ValueError("need 0 <= min_token_id < max_token_id")


# --help text of each BenchConfig field's flag.
FIELD_HELP = {
    "base_url": "the server to load (any OpenAI-compatible endpoint)",
    "model": "model name to send (default: the first model the server lists)",
    "workload": "random, shared-prefix or multi-round (see the module docstring)",
    "num_prompts": "random: requests to send",
    "input_len_min": "random: shortest prompt, tokens",
    "input_len_max": "random: longest prompt, tokens",
    "output_len": "tokens generated per request (ignore_eos)",
    "num_groups": "shared-prefix: groups of prompts sharing a prefix",
    "prompts_per_group": "shared-prefix: prompts per group",
    "prefix_len": "shared-prefix: tokens of the shared prefix",
    "question_len": "shared-prefix and multi-round: tokens of each question",
    "num_users": "multi-round: users, each a sequential conversation",
    "num_rounds": "multi-round: turns per user",
    "prompt_mode": "token-ids (exact lengths) or text (random words)",
    "min_token_id": "lowest random token id (low ids are often special or byte tokens)",
    "max_token_id": "random token ids stay below this",
    "concurrency": "requests in flight at most (default: unbounded)",
    "request_rate": "Poisson arrivals per second (default: all at once)",
    "num_warmup": "untimed requests first",
    "seed": "seed of the prompt generator",
    "temperature": "sampling temperature (0: greedy)",
    "goodput_ttft_ms": "goodput counts requests under this TTFT",
    "goodput_tpot_ms": "goodput counts requests under this time per output token",
    "timeout_s": "per-request timeout",
    "api_key": "sent as 'Authorization: Bearer KEY'",
    "output_json": "write the report here",
    "disable_tqdm": "no progress bar",
    "trace": "replay this trace (Mooncake JSONL: timestamp, input_length, output_length, hash_ids)",
    "trace_length_divisor": "trace: divide prompt lengths by this (a 512-token block becomes 512/N tokens)",
    "trace_output_divisor": "trace: divide output lengths by this",
    "trace_output_cap": "trace: at most this many output tokens a request",
    "trace_time_scale": "trace: multiply timestamps and think times by this (below 1: faster than real time)",
    "trace_start_s": "trace: skip the trace's first seconds",
    "trace_duration_s": "trace: keep this many seconds of it",
    "trace_max_requests": "trace: keep at most this many requests",
    "trace_sessions": "trace: replay conversations as sessions (next turn a think time after the answer)",
    "trace_num_sessions": "trace sessions: sample this many conversations (seeded)",
    "cache_capacity_tokens": "trace: the cluster's KV capacity, for the optimal cache's bound",
}


@dataclass
class Session:
    questions: list[Prompt]
    carry_history: bool = False


# ---------------------------------------------------------------- workloads

def _random_prompt(rng: random.Random, length: int, cfg: BenchConfig) -> Prompt:
    if cfg.prompt_mode == "text":
        return " ".join(rng.choice(_WORDS) for _ in range(length))
    return [rng.randrange(cfg.min_token_id, cfg.max_token_id) for _ in range(length)]


def _concat(a: Prompt, b: Prompt) -> Prompt:
    if isinstance(a, str) and isinstance(b, str):
        return f"{a} {b}" if a else b
    assert isinstance(a, list) and isinstance(b, list)
    return a + b


def _input_len(rng: random.Random, cfg: BenchConfig) -> int:
    return rng.randint(cfg.input_len_min, cfg.input_len_max)


def build_sessions(cfg: BenchConfig, rng: random.Random) -> list[Session]:
    if cfg.workload == "random":
        return [Session([_random_prompt(rng, _input_len(rng, cfg), cfg)])
                for _ in range(cfg.num_prompts)]
    if cfg.workload == "shared-prefix":
        sessions = []
        for _ in range(cfg.num_groups):
            prefix = _random_prompt(rng, cfg.prefix_len, cfg)
            sessions += [Session([_concat(prefix, _random_prompt(rng, cfg.question_len, cfg))])
                         for _ in range(cfg.prompts_per_group)]
        rng.shuffle(sessions)
        return sessions
    if cfg.workload == "multi-round":
        return [Session([_random_prompt(rng, _input_len(rng, cfg), cfg)
                         for _ in range(cfg.num_rounds)], carry_history=True)
                for _ in range(cfg.num_users)]
    raise ValueError(f"unknown workload {cfg.workload!r}; expected one of {WORKLOADS}")


# ---------------------------------------------------------------- one request

def _payload(cfg: BenchConfig, prompt: Prompt, max_tokens: int | None) -> dict[str, Any]:
    return {"model": cfg.model, "prompt": prompt, "max_tokens": max_tokens or cfg.output_len,
            "temperature": cfg.temperature, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
            # vLLM extra: lets multi-round resend the exact answer tokens.
            "return_token_ids": isinstance(prompt, list)}


async def send_request(client: Client, cfg: BenchConfig,
                       prompt: Prompt, max_tokens: int | None = None) -> RequestResult:
    prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
    return await stream_completion(client, _payload(cfg, prompt, max_tokens), prompt_tokens)


# ---------------------------------------------------------------- load

async def _run_session(client: Client, cfg: BenchConfig, session: Session,
                       limiter: asyncio.Semaphore | None, results: list[RequestResult],
                       pbar: tqdm | None) -> None:
    history: Prompt = "" if cfg.prompt_mode == "text" else []
    for question in session.questions:
        prompt = _concat(history, question) if session.carry_history else question
        if limiter is None:
            result = await send_request(client, cfg, prompt)
        else:
            async with limiter:
                result = await send_request(client, cfg, prompt)
        results.append(result)
        if pbar is not None:
            pbar.update(1)
        # Servers without return_token_ids give no answer ids: history then has questions only.
        history = _concat(prompt, result.text if isinstance(prompt, str) else result.token_ids)


async def _run_load(client: Client, cfg: BenchConfig, sessions: list[Session],
                    pbar: tqdm | None) -> list[RequestResult]:
    limiter = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
    arrivals = random.Random(cfg.seed + 1)
    results: list[RequestResult] = []
    tasks = []
    for session in sessions:
        tasks.append(asyncio.create_task(
            _run_session(client, cfg, session, limiter, results, pbar)))
        if math.isfinite(cfg.request_rate) and cfg.request_rate > 0:
            await asyncio.sleep(arrivals.expovariate(cfg.request_rate))
    await asyncio.gather(*tasks)
    return results


async def _warm_up(client: Client, cfg: BenchConfig) -> None:
    """Untimed requests (own seed, so they do not pre-warm the measured prompts' cache)."""
    rng = random.Random(cfg.seed + 12345)
    prompts = [_random_prompt(rng, max(cfg.input_len_min, 1), cfg) for _ in range(cfg.num_warmup)]
    results = await asyncio.gather(*(send_request(client, cfg, p) for p in prompts))
    failed = [r.error for r in results if not r.success]
    if failed:
        logger.warning("%d/%d warm-up requests failed: %s", len(failed), len(results), failed[0])


async def _run_workload(client: Client, cfg: BenchConfig) -> tuple[list[RequestResult], float, dict]:
    sessions = build_sessions(cfg, random.Random(cfg.seed))
    pbar = None if cfg.disable_tqdm else tqdm(total=sum(len(s.questions) for s in sessions), desc=cfg.workload)
    start = time.perf_counter()
    results = await _run_load(client, cfg, sessions, pbar)
    duration = time.perf_counter() - start
    if pbar is not None:
        pbar.close()
    return results, duration, {}


async def _replay(client: Client, cfg: BenchConfig) -> tuple[list[RequestResult], float, dict]:
    limiter = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else contextlib.nullcontext()

    async def send(prompt: list[int], max_tokens: int) -> RequestResult:
        async with limiter:
            return await send_request(client, cfg, prompt, max_tokens)

    return await replay_trace(cfg, send)


# ---------------------------------------------------------------- entry points

async def run_benchmark(config: BenchConfig | dict[str, Any]) -> dict[str, Any]:
    """Runs one benchmark and returns the metrics (also written to config.output_json)."""
    cfg = config if isinstance(config, BenchConfig) else BenchConfig(**config)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    # limit=0: no cap (an open-loop run without --concurrency); timeouts per read, as httpx's were
    connector = aiohttp.TCPConnector(limit=cfg.concurrency or 0)
    timeout = aiohttp.ClientTimeout(total=None, connect=cfg.timeout_s, sock_read=cfg.timeout_s)
    async with aiohttp.ClientSession(headers=headers, connector=connector, timeout=timeout) as session:
        client = Client(session, cfg.base_url.rstrip("/"))
        cfg.model = cfg.model or await first_model(client)
        if cfg.num_warmup:
            await _warm_up(client, cfg)
        run = _replay if cfg.trace is not None else _run_workload
        before = await scrape_router_stages(client)  # a pdserve router's TTFT breakdown, read around the run
        results, duration, extra = await run(client, cfg)
        stages = stage_breakdown(before, await scrape_router_stages(client))
    report = {"config": asdict(cfg), **compute_metrics(results, duration, cfg), **extra,
              "ttft_breakdown": stages, "samples_s": latency_samples(results)}
    if cfg.output_json:
        with open(cfg.output_json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return report


def build_parser() -> argparse.ArgumentParser:
    """The load generator's flags, one per BenchConfig field and one per TraceScale field
    (--trace-NAME; config_from_flags gathers them), and pdserve.loadgen.cli adds the plot flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    defaults = {**asdict(BenchConfig()), **{f"trace_{k}": v for k, v in asdict(TraceScale()).items()}}
    defaults.pop("trace_scale")
    for name, value in defaults.items():
        flag = "--" + name.replace("_", "-")
        help_text = FIELD_HELP[name]
        if isinstance(value, bool):
            p.add_argument(flag, action="store_true", help=help_text)
        elif name in ("workload",):
            p.add_argument(flag, choices=WORKLOADS, default=value, help=help_text)
        elif name == "prompt_mode":
            p.add_argument(flag, choices=("token-ids", "text"), default=value, help=help_text)
        else:
            p.add_argument(flag, type=_OPTIONAL_TYPES.get(name, type(value)), default=value, help=help_text)
    return p


# The types of the flags whose default is None.
_OPTIONAL_TYPES = {"concurrency": int, "goodput_ttft_ms": float, "goodput_tpot_ms": float, "model": str,
                   "api_key": str, "output_json": str, "trace": str, "trace_output_cap": int,
                   "trace_duration_s": float, "trace_max_requests": int, "trace_num_sessions": int,
                   "cache_capacity_tokens": int}


def config_from_flags(args: dict[str, Any]) -> BenchConfig:
    """A BenchConfig from build_parser's parsed flags (the --trace-NAME ones make its trace_scale)."""
    scale = {f.name: args.pop(f"trace_{f.name}") for f in fields(TraceScale)}
    return BenchConfig(**args, trace_scale=TraceScale(**scale))
