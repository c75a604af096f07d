"""The TTFT breakdown (issue 65): each node reports where a request's first token went
(pdserve.protocol.timing), the router observes each stage in /metrics, and `pdserve bench`
reads them back. On a real 1P1D NIXL cluster: every stage counted once per request, the first
token's stages adding up to the router's TTFT, and the decode node's transfer and first step."""
from __future__ import annotations

import asyncio
import math

import httpx

from pdserve.loadgen.bench import BenchConfig, run_benchmark
from pdserve.loadgen.metrics import format_report
from pdserve.loadgen.stages import scrape_stages, stage_breakdown
from pdserve.testing.up_cluster import node_stats

FIRST_TOKEN = ("router", "queue", "load", "compute", "handover", "wire")


def _hist(total: float, count: float, buckets: dict[float, float]) -> dict:
    return {"sum": total, "count": count, "buckets": buckets}


def test_breakdown_is_the_difference_of_two_scrapes():
    before = {"compute": _hist(1.0, 2, {0.1: 1, 1.0: 2, math.inf: 2})}
    after = {"compute": _hist(2.0, 6, {0.1: 3, 1.0: 6, math.inf: 6}), "wire": _hist(0.004, 4, {0.005: 4, math.inf: 4})}
    out = stage_breakdown(before, after)
    assert out["compute"]["requests"] == 4 and out["compute"]["mean_ms"] == 250.0
    assert out["compute"]["p50_ms"] == 100.0  # 2 of 4 new ones at or under 0.1 s: the median is that edge
    assert out["wire"] == {"mean_ms": 1.0, "p50_ms": 2.5, "requests": 4}
    assert stage_breakdown(before, None) is None


def _ttft_hist(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("pdserve_request_ttft_seconds_")}
    return values["pdserve_request_ttft_seconds_sum"], values["pdserve_request_ttft_seconds_count"]


def test_bench_reports_each_stage_of_a_pd_request(plain_cluster):
    n = 4
    cfg = BenchConfig(base_url=plain_cluster, workload="random", num_prompts=n, input_len_min=40, input_len_max=80,
                      output_len=4, max_token_id=250, num_warmup=0, concurrency=1, disable_tqdm=True)
    sum0, count0 = _ttft_hist(plain_cluster)
    report = asyncio.run(run_benchmark(cfg))
    sum1, count1 = _ttft_hist(plain_cluster)
    assert report["completed"] == n and count1 - count0 == n, report["errors"]
    stages = report["ttft_breakdown"]
    for stage in (*FIRST_TOKEN, "transfer", "first_decode_step"):
        assert stages[stage]["requests"] == n, stage
    # The first token's stages add up to the router's TTFT (the wire's share is the rest)...
    first_token_ms = sum(stages[s]["mean_ms"] for s in FIRST_TOKEN)
    assert abs(first_token_ms - (sum1 - sum0) / n * 1e3) < 0.5
    # ... the prompt's compute is a real share of it, and the pull and decode step took time
    assert stages["compute"]["mean_ms"] > 0.1 and stages["load"]["mean_ms"] == 0.0  # nothing stored to load
    assert stages["transfer"]["mean_ms"] > 0 and stages["first_decode_step"]["mean_ms"] > 0
    assert "TTFT breakdown (ms)" in format_report(report)


async def _scrape(url: str) -> dict[str, dict] | None:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        return await scrape_stages(client)


def _handover_stage_s(url: str) -> float:
    """Seconds the router counted in first tokens' handover stage so far."""
    return (asyncio.run(_scrape(url)) or {}).get("handover", {"sum": 0.0})["sum"]


def _store_put_s(url: str) -> float:
    """Seconds the prefill nodes spent putting handovers into the store (their NodeStats)."""
    return sum(n.get("transfer_us_store", 0) for n in node_stats(url).values() if n["role"] == "prefill") / 1e6


def test_a_store_puts_first_token_does_not_wait_for_the_put(store_cluster):
    """Pull mode through the store: the prefill node sends the first token before its put
    (PrefillRequest.put_after_token) and the handover after it; the router sends the decode node
    the request once it comes. The puts took their time, the first tokens waited for none of it:
    a first token that waited for its put would count the put in its handover stage."""
    n = 4
    cfg = BenchConfig(base_url=store_cluster, workload="random", num_prompts=n, input_len_min=300, input_len_max=400,
                      output_len=4, max_token_id=250, num_warmup=0, concurrency=1, disable_tqdm=True)
    handover0, put0 = _handover_stage_s(store_cluster), _store_put_s(store_cluster)
    report = asyncio.run(run_benchmark(cfg))
    assert report["completed"] == n, report["errors"]
    handover_s, put_s = _handover_stage_s(store_cluster) - handover0, _store_put_s(store_cluster) - put0
    assert put_s > 0  # every request was handed over through the store
    assert handover_s < 0.25 * put_s, (handover_s, put_s)
