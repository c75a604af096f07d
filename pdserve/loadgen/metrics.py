"""The load generator's report: throughput, goodput and latency percentiles from the requests'
results (one RequestResult per request), as vLLM's benchmark_serving names them."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdserve.loadgen.stages import format_breakdown


class GoodputTargets(Protocol):
    """What goodput is judged by (bench.BenchConfig has both): None counts every request."""
    goodput_ttft_ms: float | None
    goodput_tpot_ms: float | None


@dataclass
class RequestResult:
    success: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the server says

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _stats(name: str, values_s: Sequence[float]) -> dict[str, float | None]:
    ms = [v * 1000.0 for v in values_s]
    out: dict[str, float | None] = {f"mean_{name}_ms": sum(ms) / len(ms) if ms else None}
    for q in (50, 90, 99):
        out[f"p{q}_{name}_ms"] = percentile(ms, q)
    return out


def _is_good(r: RequestResult, cfg: GoodputTargets) -> bool:
    if cfg.goodput_ttft_ms is not None and (r.ttft_s or 0) * 1000 > cfg.goodput_ttft_ms:
        return False
    tpot = r.tpot_s
    return cfg.goodput_tpot_ms is None or tpot is None or tpot * 1000 <= cfg.goodput_tpot_ms


def compute_metrics(results: list[RequestResult], duration_s: float,
                    cfg: GoodputTargets) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    inp, outp = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    slo = cfg.goodput_ttft_ms is not None or cfg.goodput_tpot_ms is not None
    metrics: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration_s,
        "total_input_tokens": inp, "total_output_tokens": outp,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": outp / duration_s,
        "total_token_throughput": (inp + outp) / duration_s,
        "goodput": sum(_is_good(r, cfg) for r in ok) / duration_s if slo else None,
    }
    metrics |= _stats("ttft", [r.ttft_s for r in ok if r.ttft_s is not None])
    metrics |= _stats("tpot", [t for r in ok if (t := r.tpot_s) is not None])
    metrics |= _stats("itl", [itl for r in ok for itl in r.itls_s])
    metrics |= _stats("e2e", [r.e2e_s for r in ok])
    metrics["cached_token_share"] = _cached_share(ok)
    metrics["errors"] = [r.error for r in results if not r.success][:10]
    return metrics


def _cached_share(ok: list[RequestResult]) -> float | None:
    """The share of prompt tokens the server says it served from cache (None: it never said)."""
    told = [r for r in ok if r.cached_tokens is not None]
    return sum(r.cached_tokens for r in told) / max(1, sum(r.prompt_tokens for r in told)) if told else None


def latency_samples(results: list[RequestResult]) -> dict[str, list[float]]:
    """Per-request latencies for plots (pdserve.loadgen.plot)."""
    ok = [r for r in results if r.success]
    return {"ttft": [r.ttft_s for r in ok if r.ttft_s is not None], "e2e": [r.e2e_s for r in ok],
            "itl": [itl for r in ok for itl in r.itls_s]}


def format_report(report: dict[str, Any]) -> str:
    keys = [k for k in report if k not in ("config", "errors", "samples_s", "ttft_breakdown")]
    lines = [f"{k:>26}: {report[k]:.3f}" if isinstance(report[k], float)
             else f"{k:>26}: {report[k]}" for k in keys]
    if report.get("ttft_breakdown"):
        lines.append(format_breakdown(report["ttft_breakdown"]))
    if report.get("errors"):
        lines.append(f"{'first error':>26}: {report['errors'][0]}")
    return "\n".join(lines)
