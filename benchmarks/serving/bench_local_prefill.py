"""Where conditional disaggregation breaks even: a follow-up that lacks N prompt tokens on the
decode node that holds its history, prefilled there (local) or through the prefill node and a
NIXL handover (disaggregated), while other streams keep decoding on the same node.

For each N: open a conversation (256-token prompt, 16-token reply), then send the follow-up
(history + N new tokens) and time its first token; `--trials` conversations per N, medians.
Background: `--streams` clients decode 128-token answers without pause on the same cluster, so
a local prefill competes with real decode work; their inter-token p50 is reported too.

    .venv/bin/python -m benchmarks.serving.bench_local_prefill --trials 5
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import openai

from pdserve.testing.up_cluster import running_cluster

CLUSTER = ("--kv-transfer", "nixl", "--prefill-nodes", "1", "--decode-nodes", "1", "--num-kv-blocks", "2048")
MODES = {"disaggregated": ("--local-prefill-threshold", "0"), "local": ("--local-prefill-threshold", "100000")}


def stream(client, prompt: list[int], max_tokens: int) -> tuple[float, list[int], list[float]]:
    """(TTFT, token ids, chunk arrival times)"""
    t0 = time.perf_counter()
    ids, times = [], []
    for chunk in client.completions.create(model="builtin:tiny", prompt=prompt, max_tokens=max_tokens, stream=True,
                                           temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True}):
        if chunk.choices:
            times.append(time.perf_counter())
            ids += chunk.choices[0].model_extra.get("token_ids") or []
    return times[0] - t0, ids, times


def background(url: str, stop: threading.Event, gaps: list[float], seed: int) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    k = 0
    while not stop.is_set():
        _, _, times = stream(client, [(seed * 31 + k * 7 + i) % 200 + 20 for i in range(32)], 128)
        gaps += [b - a for a, b in zip(times, times[1:])]
        k += 1


def measure(flags: tuple, sizes: list[int], trials: int, streams: int) -> tuple[dict, float]:
    with running_cluster(*CLUSTER, *flags) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        stop, gaps = threading.Event(), []
        workers = [threading.Thread(target=background, args=(url, stop, gaps, s)) for s in range(streams)]
        for w in workers:
            w.start()
        ttft = {}
        try:
            for n in sizes:
                runs = []
                for t in range(trials):
                    opening = [(n * 13 + t * 101 + i * 17) % 200 + 20 for i in range(256)]
                    _, reply, _ = stream(client, opening, 16)
                    follow = opening + reply + [(n + t + i * 3) % 200 + 20 for i in range(n)]
                    runs.append(stream(client, follow, 1)[0])
                ttft[n] = 1e3 * statistics.median(runs)
        finally:
            stop.set()
            for w in workers:
                w.join()
    return ttft, 1e3 * statistics.median(gaps) if gaps else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="16,32,64,128,256,512")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--streams", type=int, default=4)
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    results = {mode: measure(flags, sizes, args.trials, args.streams) for mode, flags in MODES.items()}
    print("| missing tokens | disaggregated TTFT ms | local TTFT ms | local / disaggregated |")
    print("|---:|---:|---:|---:|")
    for n in sizes:
        disagg, local = results["disaggregated"][0][n], results["local"][0][n]
        print(f"| {n} | {disagg:.1f} | {local:.1f} | {local / disagg:.2f} |")
    print(f"\nbackground inter-token p50: disaggregated {results['disaggregated'][1]:.1f} ms, "
          f"local {results['local'][1]:.1f} ms")


if __name__ == "__main__":
    main()
