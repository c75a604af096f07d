"""The Grafana dashboard (monitoring/grafana/pdserve-dashboard.json) queries only metrics the
router really exports: every pdserve_ name in every panel's PromQL is checked against the metric
families of a live `pdserve up` cluster's /metrics (1 prefill + 1 decode node over NIXL, one
request served). tests/test_compose_demo.py runs the same queries through Prometheus."""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest

DASHBOARD = Path(__file__).resolve().parent.parent / "monitoring" / "grafana" / "pdserve-dashboard.json"
METRIC_NAME = re.compile(r"\bpdserve_[a-zA-Z0-9_]+")
SAMPLE_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")
PANEL_SUBJECTS = ("first token", "inter-token", "end-to-end", "throughput", "kv blocks", "hit rate",
                  "transfer rate", "errors")


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL expr) for every target of every panel."""
    doc = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in doc["panels"] for t in p.get("targets", [])]


def exported_families(exposition: str) -> set[str]:
    """Metric family names from a Prometheus text exposition's # TYPE lines (prometheus_client
    writes one for every registered family, with or without samples)."""
    return {line.split()[2] for line in exposition.splitlines() if line.startswith("# TYPE ")}


def missing_metrics(expr: str, families: set[str]) -> list[str]:
    """The pdserve_ series names in `expr` that no exported family can produce."""
    missing = []
    for name in METRIC_NAME.findall(expr):
        stems = {name} | {name[: -len(s)] for s in SAMPLE_SUFFIXES if name.endswith(s)}
        if not stems & families:
            missing.append(name)
    return missing


def test_dashboard_has_the_panels_the_issue_asks_for():
    doc = json.loads(DASHBOARD.read_text())
    titles = " | ".join(p["title"].lower() for p in doc["panels"])
    for subject in PANEL_SUBJECTS:
        assert subject in titles, f"no panel about {subject!r}: {titles}"
    for title, expr in dashboard_queries():
        assert METRIC_NAME.search(expr), f"panel {title!r} queries no pdserve_ metric: {expr}"
    assert all(p.get("targets") for p in doc["panels"])


@pytest.fixture(scope="module")
def metrics_text(plain_cluster):
    """/metrics after a completion, from one prefill and one decode node over NIXL (conftest's
    cluster, shared with other modules)."""
    client = openai.OpenAI(base_url=f"{plain_cluster}/v1", api_key="none", max_retries=0, timeout=120)
    client.completions.create(model="builtin:tiny", prompt=list(range(20, 120)), max_tokens=8, temperature=0)
    return httpx.get(f"{plain_cluster}/metrics", timeout=10).text


def test_every_dashboard_query_names_an_exported_metric(metrics_text):
    families = exported_families(metrics_text)
    assert "pdserve_request_ttft_seconds" in families  # the exposition really was read
    missing = {title: m for title, expr in dashboard_queries() if (m := missing_metrics(expr, families))}
    assert not missing, f"dashboard queries metrics the router does not export: {missing}"


def test_the_check_catches_an_unknown_metric(metrics_text):
    families = exported_families(metrics_text)
    assert missing_metrics("rate(pdserve_made_up_seconds_bucket[1m])", families) == ["pdserve_made_up_seconds_bucket"]
    assert missing_metrics("rate(pdserve_request_ttft_seconds_bucket[1m])", families) == []
