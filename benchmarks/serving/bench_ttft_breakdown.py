"""Where a request's first token goes, by stage (pdserve_request_stage_seconds, as `pdserve
bench` prints it), on 1P1D over NIXL and over the store, each in pull and push mode
(--handover), and one monolithic node, side by side: the clusters run at once and their runs
alternate; medians over --repeats runs.

    python -m benchmarks.serving.bench_ttft_breakdown --repeats 3
    python -m benchmarks.serving.bench_ttft_breakdown --configs pd-nixl pd-nixl-push
    python -m benchmarks.serving.bench_ttft_breakdown --model SmolLM2-135M-Instruct --input-len 2048 \
        --num-prompts 8 --configs pd-nixl-push pd-nixl-push-whole   # layer-wise streaming against whole blocks
    python -m benchmarks.serving.bench_ttft_breakdown --model SmolLM2-135M-Instruct --request-rate 1 \
        --configs pd-nixl-push pd-nixl-push-lend monolithic

pd-nixl-push WRITEs each step's blocks a group of layers at a time as the layers compute (the
default, `--push-layer-groups 4`), pd-nixl-push-whole whole blocks after each step (0).

The pd configs run each node on its own core (`--no-lend-idle-cores`), but pd-nixl-lend and
pd-nixl-push-lend, which lend as `pdserve up` does by default: a prefill step of a long prompt
borrows the decode node's core when that node has idled 0.25 s (pdserve.node.core_board).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics

from benchmarks.support.cluster import local_cluster
from pdserve.loadgen.bench import BenchConfig, run_benchmark
from pdserve.router.dispatch.metrics import STAGES

PD = ("--local-prefill-threshold", "0", "--prefill-placement", "threshold", "--kv-cache-memory-gb", "0.5")
NO_LEND = ("--no-lend-idle-cores",)  # each node on its own core: the -lend configs lend (the default)
CONFIGS = {
    "pd-nixl": ("--prefill-nodes", "1", "--decode-nodes", "1", "--kv-transfer", "nixl", *PD, *NO_LEND),
    "pd-nixl-push": ("--prefill-nodes", "1", "--decode-nodes", "1", "--kv-transfer", "nixl", "--handover", "push", *PD,
                     *NO_LEND),
    "pd-nixl-push-whole": ("--prefill-nodes", "1", "--decode-nodes", "1", "--kv-transfer", "nixl", "--handover", "push",
                           "--push-layer-groups", "0", *PD, *NO_LEND),
    "pd-store": ("--prefill-nodes", "1", "--decode-nodes", "1", "--kv-transfer", "store", *PD, *NO_LEND),
    "pd-store-push": ("--prefill-nodes", "1", "--decode-nodes", "1", "--kv-transfer", "store", "--handover", "push",
                      *PD, *NO_LEND),
    "pd-nixl-lend": ("--prefill-nodes", "1", "--decode-nodes", "1", "--kv-transfer", "nixl", "--lend-idle-cores", *PD),
    "pd-nixl-push-lend": ("--prefill-nodes", "1", "--decode-nodes", "1", "--kv-transfer", "nixl", "--handover", "push",
                          "--lend-idle-cores", *PD),
    "monolithic": ("--prefill-nodes", "0", "--decode-nodes", "1", "--kv-cache-memory-gb", "0.5"),
}
TOTALS = {"TTFT (client)": "mean_ttft_ms", "TTFT p50 (client)": "p50_ttft_ms", "end to end p50": "p50_e2e_ms"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="builtin:tiny")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second (default: each as the last ends; at 1 a second the "
                        "decode node idles between requests, so --lend-idle-cores lends its core)")
    p.add_argument("--max-token-id", type=int, default=250)
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    args = p.parse_args()
    runs: dict[str, list[dict]] = {name: [] for name in args.configs}
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(local_cluster(*CONFIGS[name], "--model", args.model)).url
                for name in args.configs}
        for rep in range(args.repeats):
            for name, url in urls.items():  # alternate: a noisy minute hits every config
                cfg = BenchConfig(base_url=url, workload="random", num_prompts=args.num_prompts,
                                  input_len_min=args.input_len, input_len_max=args.input_len,
                                  output_len=args.output_len, concurrency=args.concurrency, request_rate=args.request_rate,
                                  max_token_id=args.max_token_id, num_warmup=2, seed=rep, disable_tqdm=True)
                runs[name].append(asyncio.run(run_benchmark(cfg)))
    print(f"| stage (mean ms, median of {args.repeats}) | " + " | ".join(runs) + " |")
    print("|" + " --- |" * (len(runs) + 1))
    for stage in (*STAGES, *TOTALS):
        cells = []
        for name in runs:
            values = [r[TOTALS[stage]] if stage in TOTALS else
                      (r["ttft_breakdown"] or {}).get(stage, {}).get("mean_ms") for r in runs[name]]
            values = [v for v in values if v is not None]
            cells.append(f"{statistics.median(values):.1f}" if values else "-")
        print(f"| {stage} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
