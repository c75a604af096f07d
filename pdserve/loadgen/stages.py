"""The TTFT breakdown of a run, read from a pdserve router's /metrics before and after it: each
stage's mean and median over the run's requests (pdserve_request_stage_seconds, whose stages
pdserve.router.dispatch.metrics.STAGES describes). Another server has no such series: None."""
from __future__ import annotations

import math
from collections import defaultdict

import httpx
from prometheus_client.parser import text_string_to_metric_families

METRIC = "pdserve_request_stage_seconds"


async def scrape_stages(client: httpx.AsyncClient) -> dict[str, dict] | None:
    """{stage: {"sum": s, "count": n, "buckets": {le: cumulative count}}}; None without the series."""
    try:
        resp = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    return parse_stages(resp.text) if resp.status_code == 200 else None


def parse_stages(metrics_text: str) -> dict[str, dict] | None:
    """scrape_stages' answer from a /metrics body already read."""
    stages: dict[str, dict] = defaultdict(lambda: {"sum": 0.0, "count": 0.0, "buckets": {}})
    for family in text_string_to_metric_families(metrics_text):
        if family.name != METRIC:
            continue
        for sample in family.samples:
            stage = stages[sample.labels["stage"]]
            if sample.name.endswith("_sum"):
                stage["sum"] = sample.value
            elif sample.name.endswith("_count"):
                stage["count"] = sample.value
            elif sample.name.endswith("_bucket"):
                stage["buckets"][float(sample.labels["le"])] = sample.value
    return dict(stages) if stages else None


def stage_breakdown(before: dict | None, after: dict | None) -> dict[str, dict[str, float]] | None:
    """Per stage, over the requests between the two scrapes: mean_ms, p50_ms (interpolated in
    its histogram bucket) and the requests it counts."""
    if after is None:
        return None
    out = {}
    for stage, now in after.items():
        then = (before or {}).get(stage, {"sum": 0.0, "count": 0.0, "buckets": {}})
        count = now["count"] - then["count"]
        if count <= 0:
            continue
        buckets = {le: c - then["buckets"].get(le, 0.0) for le, c in now["buckets"].items()}
        out[stage] = {"mean_ms": (now["sum"] - then["sum"]) / count * 1e3,
                      "p50_ms": _median_ms(buckets, count), "requests": int(count)}
    return out


def _median_ms(buckets: dict[float, float], count: float) -> float:
    """The median from cumulative bucket counts, linear within its bucket (as histogram_quantile)."""
    low_edge, low_count, half = 0.0, 0.0, count / 2
    for le in sorted(buckets):
        if buckets[le] >= half:
            if math.isinf(le):
                return low_edge * 1e3
            share = (half - low_count) / max(buckets[le] - low_count, 1e-12)
            return (low_edge + (le - low_edge) * share) * 1e3
        low_edge, low_count = le, buckets[le]
    return low_edge * 1e3


def format_breakdown(breakdown: dict[str, dict[str, float]]) -> str:
    lines = [f"{'TTFT breakdown (ms)':>26}:   mean     p50  requests"]
    for stage, row in breakdown.items():
        lines.append(f"{stage:>26}: {row['mean_ms']:7.1f} {row['p50_ms']:7.1f}  {row['requests']}")
    return "\n".join(lines)
