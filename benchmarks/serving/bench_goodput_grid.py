"""Goodput over a grid of workloads of the goodput benchmark's shape: prompt-length ranges x output
lengths x three Poisson rates, for P/D and the monolithic layouts of the same cores, beside each other.

Each layout is one `pdserve up` (bench_goodput.LAYOUTS), started once and loaded with every cell in
turn; every cell has its own prompts, the same for every layout. A cell's rates scale with its
prompt lengths (a 512-2048 prompt costs about six times a 64-256 one), so that each cell's rates run
from comfortable to past what the cores hold. Beside the attainment, each P/D row reports where
its prompts were prefilled: the decode node's share (`prefills_local` against
`prefills_handed_over` in its /health) and the prefill node's whole requests, so that the
decode node's share can be read against the prefill node's queue.

    .venv/bin/python -m benchmarks.serving.bench_goodput_grid --requests 16 --json grid.json
    .venv/bin/python -m benchmarks.serving.bench_goodput_grid --model builtin:tiny --requests 4   # a quick check
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os

from benchmarks.serving.bench_goodput import LAYOUTS
from benchmarks.support.cluster import local_cluster, source_info
from pdserve.loadgen.bench import BenchConfig, run_benchmark
from pdserve.models.gguf import DEFAULT_MODEL

# Prompt-length range -> its three rates (req/s): from about half of what 2 cores prefill to
# about twice it.
PROMPT_RANGES = {(64, 256): (1.0, 2.0, 4.0), (128, 512): (0.5, 1.0, 2.0), (512, 2048): (0.125, 0.25, 0.5)}
OUTPUT_LENS = (16, 128)


@dataclasses.dataclass(frozen=True)
class Cell:
    prompt_min: int
    prompt_max: int
    output_len: int
    rate: float

    @property
    def name(self) -> str:
        return f"{self.prompt_min}-{self.prompt_max} in, {self.output_len} out, {self.rate:g} req/s"


def cells(ranges: dict, outputs: tuple[int, ...]) -> list[Cell]:
    return [Cell(lo, hi, out, rate) for (lo, hi), rates in ranges.items() for out in outputs for rate in rates]


FULL_GRID = cells(PROMPT_RANGES, OUTPUT_LENS)


def cell_config(url: str, cell: Cell, args, index: int) -> BenchConfig:
    # Each cell its own seed: a cell repeating an earlier cell's prompts would be served from cache.
    return BenchConfig(base_url=url, workload="random", input_len_min=cell.prompt_min, input_len_max=cell.prompt_max,
                       output_len=cell.output_len, num_prompts=args.requests, request_rate=cell.rate,
                       seed=7919 * (index + 1), num_warmup=0, goodput_ttft_ms=args.ttft_slo_ms,
                       goodput_tpot_ms=args.itl_slo_ms, disable_tqdm=True, min_token_id=min(100, args.vocab // 4),
                       max_token_id=min(30000, args.vocab))


def placements(c) -> dict[str, int]:
    """The decode nodes' prefill counts and the router's placement counts, summed."""
    health = c.health()
    out = {k: 0 for k in ("prefills_local", "prefills_handed_over")}
    for node in health["nodes"]:
        for k in out:
            out[k] += node.get(k, 0)
    failover = health.get("failover", {})
    out.update({k: failover.get(k, 0) for k in ("placed_local", "placed_remote", "placed_whole")})
    return out


def run_layout(name: str, grid: list[Cell], args) -> dict[str, dict]:
    transfer = () if "--kv-transfer" in LAYOUTS[name] else ("--kv-transfer", "nixl")
    flags = LAYOUTS[name] + ("--model", args.model, "--ttft-slo-ms", str(args.ttft_slo_ms),
                             "--itl-slo-ms", str(args.itl_slo_ms), *transfer)
    out: dict[str, dict] = {}
    with local_cluster(*flags, log_path=os.path.join(args.log_dir, f"grid-{name}.log")) as c:
        warm = dataclasses.replace(cell_config(c.url, grid[0], args, 10_000), num_prompts=2, request_rate=math.inf)
        asyncio.run(run_benchmark(warm))  # untimed: first steps, the nodes' first cost measurements
        for cell in grid:
            before = placements(c)
            row = measure_cell(c.url, cell, args, FULL_GRID.index(cell))  # (its seed: as in the whole grid)
            after = placements(c)
            row.update({k: after[k] - before[k] for k in after})
            out[cell.name] = row
            print(f"{name} | {cell.name}: {json.dumps(row)}", flush=True)
    return out


def measure_cell(url: str, cell: Cell, args, index: int) -> dict:
    report = asyncio.run(run_benchmark(cell_config(url, cell, args, index)))
    sent = report["completed"] + report["failed"]
    good = round((report["goodput"] or 0.0) * report["duration_s"])
    return {"attainment": good / sent if sent else 0.0, "failed": report["failed"],
            "ttft_p50_ms": report["p50_ttft_ms"], "ttft_p90_ms": report["p90_ttft_ms"],
            "tpot_p90_ms": report["p90_tpot_ms"]}


def table(results: dict[str, dict[str, dict]], grid: list[Cell]) -> str:
    names = list(results)
    lines = ["| prompt tokens | output | rate | " + " | ".join(names) + " | decode node's prefill share (P/D) |",
             "|---|---:|---:|" + "---:|" * len(names) + "---:|"]
    for cell in grid:
        row = [results[n].get(cell.name) for n in names]
        best_mono = max((r["attainment"] for n, r in zip(names, row) if r and n.startswith("mono")), default=None)
        cells_txt = []
        for n, r in zip(names, row):
            txt = "-" if r is None else f"{r['attainment']:.0%}"
            if r and n.startswith("pd") and best_mono is not None and r["attainment"] < best_mono:
                txt += " (below)"
            cells_txt.append(txt)
        pd = next((r for n, r in zip(names, row) if r and n.startswith("pd")), None)  # the first P/D layout
        share = "-"
        if pd and pd["prefills_local"] + pd["prefills_handed_over"]:
            share = f"{pd['prefills_local'] / (pd['prefills_local'] + pd['prefills_handed_over']):.0%}"
        lines.append(f"| {cell.prompt_min}-{cell.prompt_max} | {cell.output_len} | {cell.rate:g} | "
                     + " | ".join(cells_txt) + f" | {share} |")
    return "\n".join(lines)


def _only(ranges: dict, wanted: str | None) -> dict:
    if wanted is None:
        return ranges
    keep = {tuple(int(x) for x in r.split("-")) for r in wanted.split(",")}
    return {r: rates for r, rates in ranges.items() if r in keep}


def _only_outputs(wanted: str | None) -> tuple[int, ...]:
    return OUTPUT_LENS if wanted is None else tuple(int(x) for x in wanted.split(","))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--vocab", type=int, default=49152, help="random token ids stay below min(30000, this)")
    p.add_argument("--layouts", default="pd-slo,mono-2x1,mono-1x2")
    p.add_argument("--requests", type=int, default=16, help="requests per cell")
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    p.add_argument("--itl-slo-ms", type=float, default=100.0)
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--json", default=None)
    p.add_argument("--prompt-ranges", default=None, help="only these, as 64-256,512-2048 (default: all three)")
    p.add_argument("--outputs", default=None, help="only these output lengths, as 16,128 (default: both)")
    args = p.parse_args()
    grid = cells(_only(PROMPT_RANGES, args.prompt_ranges), _only_outputs(args.outputs))
    results: dict[str, dict[str, dict]] = {}
    for name in args.layouts.split(","):
        results[name] = run_layout(name, grid, args)
        print(table(results, grid), flush=True)
        if args.json:  # after every layout: a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"source": source_info(), "args": vars(args), "load": os.getloadavg(),
                           "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
