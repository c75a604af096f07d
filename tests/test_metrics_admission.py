"""The router's door and gauges on a real cluster: API key (401), body size (413), requests in
flight (429 with Retry-After), no healthy node (503 with Retry-After), all in OpenAI's error
shape and declared in the OpenAPI document; /metrics in Prometheus text with the pdserve_ names,
and KV blocks in use back to 0 once traffic drains."""
from __future__ import annotations

import concurrent.futures as cf
import os
import signal

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.testing.up_cluster import node_pids, running_cluster, wait_for

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def cluster():
    with running_cluster("--prefill-nodes", "1", "--decode-nodes", "1", "--kv-transfer", "nixl",
                         "--num-kv-blocks", "256", "--api-key", KEY, "--max-queued-requests", "3",
                         "--max-body-bytes", "65536") as (url, proc):
        yield url, proc


def _samples(url: str) -> dict[str, list]:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _is_openai_error(resp: httpx.Response, status: int) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["message"] and err["type"]


def test_api_key_is_required_on_v1_only(cluster):
    url, _ = cluster
    _is_openai_error(httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}), 401)
    _is_openai_error(httpx.post(f"{url}/v1/responses", json={"input": "hi", "max_output_tokens": 2}), 401)
    _is_openai_error(httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model="builtin:tiny", prompt="hi", max_tokens=2).choices[0].text is not None
    assert httpx.get(f"{url}/health").status_code == 200 and httpx.get(f"{url}/metrics").status_code == 200


def test_oversized_body_is_413(cluster):
    url, _ = cluster
    body = {"prompt": "x" * 70000, "max_tokens": 1}
    _is_openai_error(httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=30), 413)


def test_requests_beyond_the_limit_get_429_with_retry_after(cluster):
    url, _ = cluster
    body = {"prompt": "keep the slots busy", "max_tokens": 300, "ignore_eos": True, "temperature": 0}
    with cf.ThreadPoolExecutor(8) as pool:
        resps = list(pool.map(lambda _: httpx.post(f"{url}/v1/completions", json=body, headers=AUTH,
                                                   timeout=120), range(8)))
    codes = sorted(r.status_code for r in resps)
    assert codes.count(200) >= 3 and 429 in codes, codes
    refused = next(r for r in resps if r.status_code == 429)
    _is_openai_error(refused, 429)
    assert refused.headers["retry-after"] == "1"


def test_metrics_names_counts_and_blocks_back_to_zero(cluster):
    url, _ = cluster
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    for _ in range(3):
        list(client.completions.create(model="builtin:tiny", prompt="count me", max_tokens=5, stream=True))
    samples = _samples(url)
    for name in ("pdserve_request_ttft_seconds", "pdserve_request_inter_token_latency_seconds",
                 "pdserve_request_e2e_latency_seconds", "pdserve_request_queue_time_seconds",
                 "pdserve_requests", "pdserve_kv_blocks_in_use", "pdserve_kv_blocks_free",
                 "pdserve_node_running_requests", "pdserve_node_healthy", "pdserve_kv_transfer_bytes"):
        assert name in samples, name
    ttft_count = next(s.value for s in samples["pdserve_request_ttft_seconds"] if s.name.endswith("_count"))
    assert ttft_count >= 3
    assert sum(s.value for s in samples["pdserve_requests"] if s.labels.get("finish_reason") == "length") >= 3
    assert sum(s.value for s in samples["pdserve_kv_transfer_bytes"] if s.labels["path"] == "nixl") > 0
    errors = {s.labels["kind"]: s.value for s in samples.get("pdserve_request_errors", [])}
    assert errors.get("unauthorized", 0) >= 1
    wait_for(lambda: sum(s.value for s in _samples(url)["pdserve_kv_blocks_in_use"]) == 0, timeout_s=30)


def test_openapi_declares_every_status(cluster):
    url, _ = cluster
    doc = httpx.get(f"{url}/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        declared = set(doc["paths"][path]["post"]["responses"])
        assert {"200", "400", "401", "404", "413", "429", "503"} <= declared, declared
    assert "ErrorResponse" in doc["components"]["schemas"]


def test_no_healthy_decode_node_is_503_with_retry_after(cluster):
    url, proc = cluster
    os.kill(node_pids(proc.pid)["decode-0"], signal.SIGKILL)
    wait_for(lambda: httpx.get(f"{url}/health").status_code == 503, timeout_s=10)
    resp = httpx.post(f"{url}/v1/completions", json={"prompt": "anyone", "max_tokens": 2}, headers=AUTH, timeout=30)
    _is_openai_error(resp, 503)
    assert resp.headers["retry-after"] == "1"
    body = {"input": "anyone", "max_output_tokens": 2}
    resp = httpx.post(f"{url}/v1/responses", json=body, headers=AUTH, timeout=30)
    _is_openai_error(resp, 503)
    # Streamed, the 200 is already out: the failure comes as an error event, then response.failed.
    streamed = httpx.post(f"{url}/v1/responses", json={**body, "stream": True}, headers=AUTH, timeout=30).text
    kinds = [line.removeprefix("event: ") for line in streamed.splitlines() if line.startswith("event: ")]
    assert kinds[0] == "response.created" and kinds[-2:] == ["error", "response.failed"], kinds
    wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, timeout_s=120)  # restarted, rejoined
