"""`pdserve bench --plot` and `--sweep-concurrency`: latency CDFs of a run, and a concurrency
sweep's output throughput against TTFT p99, one line per labelled series (this run, and any
earlier runs passed with --plot-with). `pdserve bench-plot A.json B.json -o out.png` redraws
saved runs without sending a request."""
from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from pdserve.loadgen.bench import BenchConfig, run_benchmark
from pdserve.loadgen.metrics import format_report

CDF_PANELS = (("ttft", "time to first token"), ("itl", "inter-token latency"), ("e2e", "end-to-end latency"))
Report = dict[str, Any]
Series = dict[str, list[Report]]  # label -> reports, one per sweep level (or one run)
FIG_HEIGHT_IN, PANEL_WIDTH_IN, DPI = 4.5, 5.0, 110  # a PNG is (4.5 x 110) px by (panels x 5 x 110) px

COMPARE_HELP = """\
Comparing two deployments on one figure: run the sweep against each with --label and
--output-json, then draw the saved files together, e.g.
  pdserve bench --base-url URL_A ... --sweep-concurrency 1,2,4,8,16 --label "P/D" --output-json pd.json
  pdserve bench --base-url URL_B ... --sweep-concurrency 1,2,4,8,16 --label mono --output-json mono.json \\
      --plot both.png --plot-with pd.json
or, without sending anything more: pdserve bench-plot pd.json mono.json -o both.png"""


def add_plot_arguments(p: argparse.ArgumentParser) -> None:
    """The plot/sweep flags of `pdserve bench` (bench.py stays the load generator)."""
    g = p.add_argument_group("plots and sweeps", COMPARE_HELP)
    g.add_argument("--plot", metavar="FILE.png", default=None,
                   help="CDFs of TTFT, ITL and end-to-end latency; with a sweep, also throughput against TTFT p99")
    g.add_argument("--sweep-concurrency", metavar="1,2,4,8", default=None,
                   help="run the workload at each concurrency level in turn and print a table row per level")
    g.add_argument("--label", default=None, help="this run's name in plots and in --output-json (default: the URL)")
    g.add_argument("--plot-with", metavar="RESULTS.json", nargs="+", default=[],
                   help="earlier runs' --output-json files, drawn beside this one")
    p.formatter_class = argparse.RawDescriptionHelpFormatter  # keep the example's line breaks


def run_with_plots(cfg: BenchConfig, extras: dict[str, Any]) -> int:
    """`pdserve bench` with --sweep-concurrency and/or --plot; --output-json gets {label, runs}."""
    if extras["sweep_concurrency"]:
        levels = [int(x) for x in extras["sweep_concurrency"].split(",") if x.strip()]
        reports = run_sweep(cfg, levels)
        print(sweep_table(reports))
    else:
        reports = [asyncio.run(run_benchmark(replace(cfg, output_json=None)))]
        print(format_report(reports[0]))
    label = extras["label"] or cfg.base_url
    if cfg.output_json:
        save_series(cfg.output_json, label, reports)
    if extras["plot"]:
        series = {label: reports} | dict(load_series(f) for f in extras["plot_with"])
        plot(series, extras["plot"])
        print(f"plot written to {extras['plot']}")
    return 0 if all(r["completed"] for r in reports) else 1


def run_sweep(cfg: BenchConfig, levels: list[int]) -> list[Report]:
    """One run per concurrency level; a fresh seed per level so no level reuses another's prefixes."""
    reports = []
    for i, level in enumerate(levels):
        level_cfg = replace(cfg, concurrency=level, seed=cfg.seed + 1000 * i, output_json=None,
                            num_warmup=cfg.num_warmup if i == 0 else 0)
        reports.append(asyncio.run(run_benchmark(level_cfg)))
    return reports


def sweep_table(reports: list[Report]) -> str:
    rows = ["| concurrency | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | e2e p99 ms | failed |",
            "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in reports:
        rows.append(f"| {r['config']['concurrency']} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} | "
                    f"{_ms(r, 'p50_ttft_ms')} | {_ms(r, 'p99_ttft_ms')} | {_ms(r, 'p99_e2e_ms')} | {r['failed']} |")
    return "\n".join(rows)


def _ms(report: Report, key: str) -> str:
    value = report.get(key)
    return "-" if value is None else f"{value:.0f}"


def save_series(path: str, label: str, reports: list[Report]) -> None:
    Path(path).write_text(json.dumps({"label": label, "runs": reports}, indent=1, default=str))


def load_series(path: str) -> tuple[str, list[Report]]:
    """A file from --output-json: a sweep ({label, runs}) or a single run's report."""
    doc = json.loads(Path(path).read_text())
    if "runs" in doc:
        return doc.get("label") or Path(path).stem, doc["runs"]
    return Path(path).stem, [doc]


def _cdf(ax: Any, values_s: list[float], label: str) -> None:
    xs = sorted(v * 1000 for v in values_s)
    if xs:
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label, drawstyle="steps-post")


def _log_axis(axis: Any, span: tuple[float, float]) -> None:
    """Plain numbers on a log axis (10, 20, 50, 100...), not 3x10^2; only powers of ten when the
    data spans over two decades, so the labels do not run into each other, and more ticks when
    it spans less than one, so the axis has more than one label."""
    # optional dependency: matplotlib (the pdserve[plot] extra)
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    lo, hi = span
    ratio = hi / lo if lo > 0 else float("inf")
    subs = (1.0,) if ratio > 300 else (1.0, 2.0, 5.0) if ratio > 5 else (1.0, 2.0, 3.0, 5.0, 7.0)
    axis.set_major_locator(LogLocator(subs=subs))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def plot(series: Series, path: str) -> None:
    """CDFs of each series' last run (its highest sweep level); with several levels anywhere,
    a fourth panel of output tokens/s against TTFT p99, each point marked with its concurrency."""
    import matplotlib  # optional dependency: matplotlib (the pdserve[plot] extra)
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt  # optional dependency: matplotlib (the pdserve[plot] extra)

    sweeping = any(len(reports) > 1 for reports in series.values())
    panels = 4 if sweeping else 3
    fig, axes = plt.subplots(1, panels, figsize=(PANEL_WIDTH_IN * panels, FIG_HEIGHT_IN))
    for ax, (key, title) in zip(axes, CDF_PANELS):
        for label, reports in series.items():
            last = reports[-1]
            _cdf(ax, last.get("samples_s", {}).get(key, []), f"{label} (c={last['config']['concurrency']})")
        ax.set(title=title, xlabel="ms (log)", ylabel="fraction of requests" if key != "itl" else "fraction of gaps",
               ylim=(0, 1.02))
        ax.set_xscale("log")
        _log_axis(ax.xaxis, ax.dataLim.intervalx)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")  # a CDF leaves the top left empty
    if sweeping:
        _plot_sweep(axes[3], series)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _plot_sweep(ax: Any, series: Series) -> None:
    for label, reports in series.items():
        points = [(r["output_throughput"], r.get("p99_ttft_ms"), r["config"]["concurrency"]) for r in reports
                  if r.get("p99_ttft_ms") is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        for tput, ttft, level in points:
            ax.annotate(str(level), (tput, ttft), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set(title="throughput against TTFT p99 (points: concurrency)", xlabel="output tokens/s",
           ylabel="TTFT p99 ms (log)")
    ax.margins(x=0.08, y=0.1)  # room for the concurrency labels at the ends
    ax.set_yscale("log")
    _log_axis(ax.yaxis, ax.dataLim.intervaly)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")  # latency rises with throughput: bottom right stays empty


def build_plot_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench-plot", description=plot_main.__doc__)
    p.add_argument("results", nargs="+", metavar="RESULTS.json", help="files from pdserve bench --output-json")
    p.add_argument("-o", "--output", required=True, metavar="FILE.png", help="the PNG to write")
    return p


def plot_main(argv: Sequence[str] | None = None) -> int:
    """`pdserve bench-plot A.json [B.json ...] -o out.png`: redraw saved runs on one figure."""
    args = build_plot_parser().parse_args(argv)
    series = dict(load_series(f) for f in args.results)
    for label, reports in series.items():
        print(f"{label}:\n{sweep_table(reports)}")
    plot(series, args.output)
    print(f"plot written to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(plot_main())
