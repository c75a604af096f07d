"""`pdserve bench`: the load generator (pdserve.loadgen.bench) with the plot and sweep flags
(pdserve.loadgen.plot). Both sit below this module, so neither imports the other's entry point."""
from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence

from pdserve.loadgen.bench import build_parser as build_load_parser
from pdserve.loadgen.bench import config_from_flags, run_benchmark
from pdserve.loadgen.metrics import format_report
from pdserve.loadgen.plot import add_plot_arguments, run_with_plots

PLOT_FLAGS = ("plot", "sweep_concurrency", "label", "plot_with")


def build_parser() -> argparse.ArgumentParser:
    parser = build_load_parser()
    parser.prog = "pdserve bench"
    add_plot_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    extras = {k: args.pop(k) for k in PLOT_FLAGS}
    cfg = config_from_flags(args)
    if not extras["sweep_concurrency"] and not extras["plot"]:
        report = asyncio.run(run_benchmark(cfg))
        print(format_report(report))
        return 0 if report["completed"] else 1
    return run_with_plots(cfg, extras)


if __name__ == "__main__":
    raise SystemExit(main())
