"""`pdserve bench --plot` and `--sweep-concurrency`: latency CDFs of a run, and a concurrency
sweep's output throughput against TTFT p99, one line per labelled series (this run, and any
earlier runs passed with --plot-with)."""
from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from pdserve.bench import BenchConfig, run_benchmark

CDF_PANELS = (("ttft", "time to first token"), ("itl", "inter-token latency"), ("e2e", "end-to-end latency"))
Series = dict[str, list[dict[str, Any]]]  # label -> reports, one per sweep level (or one run)


def run_sweep(cfg: BenchConfig, levels: list[int]) -> list[dict[str, Any]]:
    """One run per concurrency level; a fresh seed per level so no level reuses another's prefixes."""
    reports = []
    for i, level in enumerate(levels):
        level_cfg = replace(cfg, concurrency=level, seed=cfg.seed + 1000 * i, output_json=None,
                            num_warmup=cfg.num_warmup if i == 0 else 0)
        reports.append(asyncio.run(run_benchmark(level_cfg)))
    return reports


def sweep_table(reports: list[dict[str, Any]]) -> str:
    rows = ["| concurrency | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | e2e p99 ms | failed |",
            "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in reports:
        rows.append(f"| {r['config']['concurrency']} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} | "
                    f"{_ms(r, 'p50_ttft_ms')} | {_ms(r, 'p99_ttft_ms')} | {_ms(r, 'p99_e2e_ms')} | {r['failed']} |")
    return "\n".join(rows)


def _ms(report: dict[str, Any], key: str) -> str:
    value = report.get(key)
    return "-" if value is None else f"{value:.0f}"


def save_series(path: str, label: str, reports: list[dict[str, Any]]) -> None:
    Path(path).write_text(json.dumps({"label": label, "runs": reports}, indent=1, default=str))


def load_series(path: str) -> tuple[str, list[dict[str, Any]]]:
    """A file from --output-json: a sweep ({label, runs}) or a single run's report."""
    doc = json.loads(Path(path).read_text())
    if "runs" in doc:
        return doc.get("label") or Path(path).stem, doc["runs"]
    return Path(path).stem, [doc]


def _cdf(ax, values_s: list[float], label: str) -> None:
    xs = sorted(v * 1000 for v in values_s)
    if xs:
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label, drawstyle="steps-post")


def plot(series: Series, path: str) -> None:
    """CDFs of each series' last run (its highest sweep level); with several levels anywhere,
    a fourth panel of output tokens/s against TTFT p99, each point marked with its concurrency."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    sweeping = any(len(reports) > 1 for reports in series.values())
    fig, axes = plt.subplots(1, 4 if sweeping else 3, figsize=(20 if sweeping else 15, 4.5))
    for ax, (key, title) in zip(axes, CDF_PANELS):
        for label, reports in series.items():
            last = reports[-1]
            _cdf(ax, last.get("samples_s", {}).get(key, []), f"{label} (c={last['config']['concurrency']})")
        ax.set(title=title, xlabel="ms", ylabel="fraction of requests" if key != "itl" else "fraction of gaps",
               ylim=(0, 1.02))
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if sweeping:
        _plot_sweep(axes[3], series)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_sweep(ax, series: Series) -> None:
    for label, reports in series.items():
        points = [(r["output_throughput"], r.get("p99_ttft_ms"), r["config"]["concurrency"]) for r in reports
                  if r.get("p99_ttft_ms") is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        for tput, ttft, level in points:
            ax.annotate(str(level), (tput, ttft), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set(title="throughput against TTFT p99 (points: concurrency)", xlabel="output tokens/s",
           ylabel="TTFT p99 ms")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
