"""Speculative decoding served: a `pdserve up` cluster (1P1D by default, the router, the handover
and the decode node's verify steps all in the path) on the default model, speculation off beside
n-gram and suffix decoding, on the copy workload of benchmarks/engine/bench_spec_decode.py
("copy this passage with one word changed"), one request at a time through the official openai
client, greedy, streamed.

    .venv/bin/python -m benchmarks.serving.bench_spec_served --repeats 3

Each repeat starts each configuration's cluster in turn (alternated: off, ngram, suffix, off, ...),
warms it with one short request, then times `--requests` copy requests one after the other: a
request's output tok/s is its tokens over its whole time, from the send to the last token (the
prompt's prefill and the handover included). Medians over the repeats; the greedy texts of every
configuration must equal speculation off's (the table says so), else the figure means nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import openai

from benchmarks.engine.bench_spec_decode import CHANGES, PASSAGE
from benchmarks.support.cluster import local_cluster
from pdserve.models.gguf import DEFAULT_MODEL


def spec_configs(k: int) -> dict[str, dict | None]:
    return {"off": None,
            "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                      "prompt_lookup_max": 4},
            "suffix": {"method": "suffix", "num_speculative_tokens": k}}


def copy_ask(i: int) -> str:
    old, new = CHANGES[i % len(CHANGES)]
    return f"Copy this text exactly, but replace \"{old}\" with \"{new}\":\n\n{PASSAGE}"


def one_request(client: openai.OpenAI, model: str, text: str, new_tokens: int) -> tuple[str, int, float, float]:
    """(text, tokens, seconds from the send to the last token, TTFT in s)."""
    start, first, out, tokens = time.perf_counter(), None, [], 0
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                            max_tokens=new_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            out.append(chunk.choices[0].delta.content)
    return "".join(out), tokens, time.perf_counter() - start, (first or start) - start


def run_config(flags: list[str], spec: dict | None, args) -> dict:
    extra = ["--speculative-config", json.dumps(spec)] if spec else []
    with local_cluster("--model", args.model, *flags, *extra) as cluster:
        client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        one_request(client, model, copy_ask(99), 8)  # warm up
        texts, rates, ttfts = [], [], []
        for i in range(args.requests):
            text, tokens, seconds, ttft = one_request(client, model, copy_ask(i), args.new_tokens)
            texts.append(text)
            rates.append(tokens / seconds)
            ttfts.append(ttft)
        time.sleep(0.5)  # the nodes' counters ride on their pongs (every 0.2 s)
        nodes = cluster.health()["nodes"]
    drafted = sum(n.get("spec_num_draft_tokens", 0) for n in nodes)
    accepted = sum(n.get("spec_num_accepted_tokens", 0) for n in nodes)
    return {"tok_s": statistics.median(rates), "ttft_s": statistics.median(ttfts), "texts": texts,
            "acceptance": accepted / drafted if drafted else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=2, help="copy requests per cluster, one after the other")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--flags", default="--prefill-nodes 1 --decode-nodes 1",
                    help="pdserve up's other flags")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    args = ap.parse_args()
    configs = spec_configs(args.k)
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    print(f"uptime: {os.popen('uptime').read().strip()}")
    for repeat in range(args.repeats):
        for name, spec in configs.items():
            runs[name].append(run_config(args.flags.split(), spec, args))
            print(f"# repeat {repeat} {name}: {runs[name][-1]['tok_s']:.1f} tok/s, "
                  f"TTFT {runs[name][-1]['ttft_s'] * 1e3:.0f} ms, acceptance {runs[name][-1]['acceptance']}", flush=True)
    base = statistics.median(r["tok_s"] for r in runs["off"])
    want = runs["off"][0]["texts"]
    print(json.dumps({"flags": args.flags, "k": args.k, "new_tokens": args.new_tokens, "requests": args.requests}))
    print("| engine | output tok/s (per request) | speed-up | TTFT p50 (ms) | runs (tok/s) | greedy = off |")
    print("|---|---|---|---|---|---|")
    for name, rs in runs.items():
        rate = statistics.median(r["tok_s"] for r in rs)
        same = all(r["texts"] == want for r in rs)
        ttft_ms = statistics.median(r["ttft_s"] for r in rs) * 1e3
        each = ", ".join(f"{r['tok_s']:.1f}" for r in rs)
        print(f"| {name} | {rate:.1f} | {rate / base:.2f}x | {ttft_ms:.0f} | {each} | {same} |")
    print(f"uptime: {os.popen('uptime').read().strip()}")


if __name__ == "__main__":
    main()
