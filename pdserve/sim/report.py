"""Summaries of a simulated run: hit rate, TTFT and TPOT percentiles, throughput, handovers and
bytes moved; a text table and an optional PNG."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from pdserve.sim.nodes import SimRequest


@dataclass
class Summary:
    label: str
    requests: int
    hit_rate: float        # prompt tokens served from any cache / all prompt tokens
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    throughput_tok_s: float
    handovers: int
    local_prefills: int
    moved_mb: float

    def row(self) -> dict:
        return asdict(self)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


def summarize(label: str, done: list[SimRequest], block_bytes: int) -> Summary:
    prompt = sum(len(r.prompt) for r in done)
    ttft = [(r.first_token - r.arrival) * 1e3 for r in done]
    tpot = [(r.finish - r.first_token) * 1e3 / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    span = max((r.finish for r in done), default=0.0) - min((r.arrival for r in done), default=0.0)
    out_tokens = sum(r.output_tokens for r in done)
    return Summary(label, len(done), sum(r.cached_tokens for r in done) / prompt if prompt else 0.0,
                   percentile(ttft, 50), percentile(ttft, 99), percentile(tpot, 50), percentile(tpot, 99),
                   out_tokens / span if span > 0 else 0.0, sum(r.prefill_node is not None for r in done),
                   sum(r.prefill_node is None for r in done),
                   sum(r.handed_blocks for r in done) * block_bytes / 1e6)


def table(rows: list[Summary]) -> str:
    head = ("config", "reqs", "hit rate", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "tok/s",
            "handovers", "local", "moved MB")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in rows:
        cells = (s.label, s.requests, f"{s.hit_rate:.1%}", f"{s.ttft_p50_ms:.1f}", f"{s.ttft_p99_ms:.1f}",
                 f"{s.tpot_p50_ms:.2f}", f"{s.tpot_p99_ms:.2f}", f"{s.throughput_tok_s:.0f}", s.handovers,
                 s.local_prefills, f"{s.moved_mb:.1f}")
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def plot(rows: list[Summary], path: str) -> None:
    """Hit rate and TTFT p50/p99 per configuration, one bar group each."""
    import matplotlib  # optional dependency: matplotlib (the pdserve[plot] extra)
    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt  # optional dependency: matplotlib (the pdserve[plot] extra)
    labels = [s.label for s in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, len(rows) * 1.2), 4.5))
    ax1.bar(labels, [s.hit_rate * 100 for s in rows], color="tab:green")
    ax1.set_ylabel("prompt tokens from cache (%)")
    xs = range(len(rows))
    ax2.bar([x - 0.2 for x in xs], [s.ttft_p50_ms for s in rows], width=0.4, label="p50")
    ax2.bar([x + 0.2 for x in xs], [s.ttft_p99_ms for s in rows], width=0.4, label="p99")
    ax2.set_xticks(list(xs), labels)
    ax2.set_ylabel("TTFT (ms)")
    ax2.set_yscale("log")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=60, labelsize=7)
    fig.suptitle("pdserve simulate")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
