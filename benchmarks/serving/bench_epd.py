"""Encoder nodes (E/P/D) against plain P/D for a vision-language model, under load: SLO
attainment and TTFT of chat requests with images on `pdserve up` with 1 prefill + 1 decode node
(1P1D, the prefill node encodes the images itself) and with 1 encode + 1 prefill + 1 decode node
(1E1P1D, the encoder node encodes them and the prefill node loads the embeddings from the store),
both `--kv-transfer store`, side by side in one run on the same machine and cores.

Why: an encoder node takes the vision tower off the prefill node's critical path (and keeps its
own encoder cache), at the price of one more hop (router -> encoder -> Redis -> prefill node) and,
on a small machine, one more process to share the cores with. This measures which weighs more.

Model: a random Qwen2.5-VL (pdserve.testing.vlm_checkpoints) with the tests' tiny language model
and a vision tower made to cost something (--depth 8, --hidden 256, 4 heads, intermediate 2x
hidden, out_hidden_size 64, full attention in blocks 3, 7); 224x224 pictures (64 image tokens).

Workload (identical for both layouts: fixed seeds): --requests chat requests per rate, Poisson
arrivals at each of --rates; each asks about one picture drawn from a pool of --pool random
pictures (Zipf weights 1/k^--zipf, 0 uniform, so some pictures repeat and meet the encoder
cache), with varied text before the image (so the prefix cache stops before the image);
max_tokens 16 (ignore_eos), greedy. Each (rate, rep) draws a fresh pool, so every run encodes
its pictures anew. Sent with the official openai client (AsyncOpenAI), streamed; TTFT is the
time to the first streamed chunk that carries content, TPOT (time after the first token) / (tokens
- 1). A request meets the SLO when TTFT <= --ttft-slo-ms and TPOT <= --tpot-slo-ms.

Both clusters are started once with the same explicit flags (as_given: none of the test
defaults), `--prefill-placement threshold --local-prefill-threshold 0` so every prompt goes
through the prefill node (the path the encoder node serves), and loaded in turn at every rate,
the layout that goes first alternating. `pdserve up` splits the cores among its nodes by itself
(cores // nodes, at least 1 thread a node). Encoder counters are deltas of /health per run.

    .venv/bin/python -m benchmarks.serving.bench_epd --rates 10,25,50 --requests 40 --reps 3
    .venv/bin/python -m benchmarks.serving.bench_epd --pool 40 --zipf 0   # mostly new pictures: more to encode

Rates: on a 2-core machine 1P1D keeps up with about 25 req/s of this workload (10: well under,
25: around, 50: above, where a queue builds within the 40 requests).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

QUESTIONS = [
    "What is in this picture?", "Describe the colours you see here:", "Is there a person in this image?",
    "Count the objects shown:", "Write a short caption for this photo:", "Which season could this be?",
    "What would you title this painting?", "Is this picture taken indoors or outdoors?",
    "List three details of the scene:", "What mood does this image give?", "Where might this have been taken?",
    "What is the main subject here?",
]
WORDS = ["red", "quiet", "river", "seven", "glass", "north", "paper", "storm", "velvet", "amber", "echo", "lamp"]
COUNTERS = ("encoder_runs", "encoder_cache_hits", "embeddings_loaded")


def layouts(model: str, placement: str) -> dict[str, tuple[str, ...]]:
    common = ("--model", model, "--served-model-name", "vlm", "--kv-transfer", "store",
              "--prefill-nodes", "1", "--decode-nodes", "1")
    if placement == "threshold":
        common += ("--prefill-placement", "threshold", "--local-prefill-threshold", "0")
    return {"1P1D": common, "1E1P1D": (*common, "--encode-nodes", "1")}


def data_url(picture) -> str:
    buf = io.BytesIO()
    picture.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def workload(args, seed: int, rate: float) -> tuple[list[float], list[list[dict]], int]:
    """(arrival offsets in s, messages of each request, distinct pictures used): the same for every layout."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    pool = [data_url(Image.fromarray(rng.integers(0, 256, (args.size, args.size, 3), dtype=np.uint8)))
            for _ in range(args.pool)]
    weights = 1.0 / np.arange(1, args.pool + 1) ** args.zipf
    picks = rng.choice(args.pool, size=args.requests, p=weights / weights.sum())
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=args.requests)).tolist()
    messages = []
    for i, pick in enumerate(picks):
        words = " ".join(rng.choice(WORDS, size=int(rng.integers(2, 6))))
        before = f"[{i}] {words}. {QUESTIONS[int(rng.integers(len(QUESTIONS)))]} "
        messages.append([{"role": "user", "content": [{"type": "text", "text": before},
                                                      {"type": "image_url", "image_url": {"url": pool[pick]}},
                                                      {"type": "text", "text": " Answer briefly."}]}])
    return arrivals, messages, len(set(picks.tolist()))


async def one_request(client, messages: list[dict], max_tokens: int) -> dict:
    start = time.perf_counter()
    first = last = None
    tokens = 0
    try:
        stream = await client.chat.completions.create(
            model="vlm", messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "return_token_ids": True})
        async for chunk in stream:
            if not chunk.choices:
                continue
            ids = chunk.choices[0].model_extra.get("token_ids") or []
            if ids or chunk.choices[0].delta.content:
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
                tokens += len(ids) or 1
    except Exception as exc:  # noqa: BLE001 - a failed request counts against the SLO, and is reported
        return {"error": repr(exc)[:200]}
    if first is None:
        return {"error": "no token streamed"}
    return {"ttft": first - start, "tpot": (last - first) / (tokens - 1) if tokens > 1 else 0.0, "tokens": tokens}


async def run_load(url: str, arrivals: list[float], messages: list[list[dict]], max_tokens: int) -> list[dict]:
    import openai  # optional dependency: openai (the pdserve[test] extra)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300) as client:
        t0 = time.perf_counter()

        async def at(offset: float, msgs: list[dict]) -> dict:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            return await one_request(client, msgs, max_tokens)

        return await asyncio.gather(*(at(a, m) for a, m in zip(arrivals, messages)))


def counters(url: str) -> dict[str, dict]:
    nodes = httpx.get(f"{url}/health", timeout=10).json()["nodes"]
    return {n["role"]: {k: n.get(k, 0) for k in COUNTERS} for n in nodes}


def settled_counters(url: str) -> dict[str, dict]:
    """Node counters ride on pongs (every 0.2 s): read until two reads agree."""
    prev = counters(url)
    for _ in range(20):
        time.sleep(0.5)
        cur = counters(url)
        if cur == prev:
            return cur
        prev = cur
    return prev


def summarise(results: list[dict], ttft_slo: float, tpot_slo: float) -> dict:
    ok = [r for r in results if "error" not in r]
    ttfts = [r["ttft"] * 1e3 for r in ok] or [float("nan")]
    tpots = [r["tpot"] * 1e3 for r in ok] or [float("nan")]
    good = sum(r["ttft"] * 1e3 <= ttft_slo and r["tpot"] * 1e3 <= tpot_slo for r in ok)
    return {"attainment": good / len(results), "ttft_p50": float(np.percentile(ttfts, 50)),
            "ttft_p90": float(np.percentile(ttfts, 90)), "tpot_p50": float(np.percentile(tpots, 50)),
            "errors": len(results) - len(ok), "first_error": next((r["error"] for r in results if "error" in r), None)}


def warm_up(url: str, args) -> None:
    """Two requests with a picture of their own: the first request's one-time costs stay out of the runs."""
    arrivals, messages, _ = workload(argparse.Namespace(**{**vars(args), "pool": 1, "requests": 2}), 999_999, 100.0)
    for msgs in messages:
        asyncio.run(run_load(url, [0.0], [msgs], args.max_tokens))


def main() -> None:
    from pdserve.testing.up_cluster import running_cluster
    from pdserve.testing.vlm_checkpoints import make_qwen2_5_vl
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="10,25,50", help="Poisson request rates (req/s), comma-separated")
    parser.add_argument("--requests", type=int, default=40, help="requests per rate and rep")
    parser.add_argument("--reps", type=int, default=3, help="repetitions; medians over them")
    parser.add_argument("--pool", type=int, default=12, help="distinct pictures per run")
    parser.add_argument("--zipf", type=float, default=1.0, help="picture choice weights 1/k^zipf (0: uniform)")
    parser.add_argument("--size", type=int, default=224, help="picture side in pixels")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    parser.add_argument("--tpot-slo-ms", type=float, default=100.0)
    parser.add_argument("--depth", type=int, default=8, help="vision tower blocks")
    parser.add_argument("--hidden", type=int, default=256, help="vision tower width")
    parser.add_argument("--placement", choices=["threshold", "slo"], default="threshold",
                        help="threshold: every prompt through the prefill node; slo: pdserve up's default")
    parser.add_argument("--layouts", default="1P1D,1E1P1D")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    vision = dict(depth=args.depth, hidden_size=args.hidden, num_heads=4, intermediate_size=2 * args.hidden,
                  out_hidden_size=64, fullatt_block_indexes=list(range(3, args.depth, 4)))
    model = make_qwen2_5_vl(Path(tempfile.mkdtemp(prefix="bench-epd-")), vision_overrides=vision)
    chosen = {k: v for k, v in layouts(str(model), args.placement).items() if k in args.layouts.split(",")}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    runs: dict[tuple[str, float], list[dict]] = {}
    enc: dict[tuple[str, float], dict[str, dict]] = {}
    distinct: dict[float, list[int]] = {}
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        urls = {}
        for name, flags in chosen.items():
            urls[name], _ = stack.enter_context(running_cluster(*flags, as_given=True))
            warm_up(urls[name], args)
        print(f"clusters up and warm in {time.monotonic() - started:.0f} s", flush=True)
        turn = 0
        for rep in range(args.reps):
            for ri, rate in enumerate(rates):
                arrivals, messages, n_distinct = workload(args, args.seed * 10_000 + rep * 100 + ri, rate)
                distinct.setdefault(rate, []).append(n_distinct)
                order = list(urls) if turn % 2 == 0 else list(reversed(urls))
                turn += 1
                for name in order:
                    before = settled_counters(urls[name])
                    t = time.monotonic()
                    results = asyncio.run(run_load(urls[name], arrivals, messages, args.max_tokens))
                    after = settled_counters(urls[name])
                    s = summarise(results, args.ttft_slo_ms, args.tpot_slo_ms)
                    runs.setdefault((name, rate), []).append(s)
                    delta = {role: {k: after[role][k] - before.get(role, {}).get(k, 0) for k in COUNTERS}
                             for role in after}
                    total = enc.setdefault((name, rate), {})
                    for role, d in delta.items():
                        for k, v in d.items():
                            total.setdefault(role, {}).setdefault(k, 0)
                            total[role][k] += v
                    print(f"rep {rep} rate {rate:g} {name}: {time.monotonic() - t:.1f} s, attainment "
                          f"{s['attainment']:.0%}, TTFT p50 {s['ttft_p50']:.0f} ms, errors {s['errors']}"
                          + (f" ({s['first_error']})" if s["first_error"] else ""), flush=True)
    elapsed = time.monotonic() - started

    def med(name, rate, key):
        return statistics.median(r[key] for r in runs[(name, rate)])

    print()
    print(f"Qwen2.5-VL (random): vision tower depth {args.depth}, hidden {args.hidden}, tiny language model; "
          f"{args.size}x{args.size} pictures, pool {args.pool} a run ({'uniform' if args.zipf == 0 else f'Zipf s={args.zipf:g}'}); "
          f"{args.requests} requests per rate and rep, max_tokens {args.max_tokens}; SLO TTFT <= {args.ttft_slo_ms:g} ms "
          f"and TPOT <= {args.tpot_slo_ms:g} ms; {cores} cores, `pdserve up` gives each node cores // nodes "
          f"(at least 1) threads; --prefill-placement {args.placement}; {args.reps} rep(s)"
          + (" (medians)" if args.reps > 1 else "") + f"; whole run {elapsed:.0f} s")
    print()
    print("| layout | rate (req/s) | SLO attainment (min over reps) | TTFT p50 (ms) | TTFT p90 (ms) | TPOT p50 (ms) "
          "| TTFT p50 per rep (ms) | errors |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for rate in rates:
        for name in chosen:
            errors = sum(r["errors"] for r in runs[(name, rate)])
            worst = min(r["attainment"] for r in runs[(name, rate)])
            per_rep = " / ".join(f"{r['ttft_p50']:.0f}" for r in runs[(name, rate)])
            print(f"| {name} | {rate:g} | {med(name, rate, 'attainment'):.0%} ({worst:.0%}) | "
                  f"{med(name, rate, 'ttft_p50'):.0f} | {med(name, rate, 'ttft_p90'):.0f} | "
                  f"{med(name, rate, 'tpot_p50'):.1f} | {per_rep} | {errors} |")
    print()
    print("Encoder counters from /health, summed over the rep(s) (each run has its own pictures):")
    print()
    print("| layout | rate (req/s) | distinct pictures | encode: encoder_runs | encode: cache hits | "
          "prefill: encoder_runs | prefill: embeddings_loaded | decode: encoder_runs |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for rate in rates:
        for name in chosen:
            e = enc[(name, rate)]

            def get(role, key, e=e):
                return str(e[role][key]) if role in e else "-"
            print(f"| {name} | {rate:g} | {sum(distinct[rate])} | {get('encode', 'encoder_runs')} | "
                  f"{get('encode', 'encoder_cache_hits')} | {get('prefill', 'encoder_runs')} | "
                  f"{get('prefill', 'embeddings_loaded')} | {get('decode', 'encoder_runs')} |")


if __name__ == "__main__":
    main()
