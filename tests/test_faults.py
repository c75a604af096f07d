"""Faults against a real cluster: a client that leaves, a decode node, a prefill node and Redis
that die. Each costs at most the requests it held, each ended cleanly; nothing hangs and no
KV block stays allocated."""
from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

from cluster_util import node_pids, node_stats, running_cluster, wait_for
from pdserve import LLM, SamplingParams

LONG = {"max_tokens": 3000, "temperature": 0, "ignore_eos": True}


def _all_blocks_free(url: str) -> bool:
    return all(n["free_blocks"] == n["total_blocks"] and n["requests"] == 0
               for n in node_stats(url).values() if n["healthy"])


@pytest.fixture(scope="module")
def cluster():
    with running_cluster("--kv-transfer", "nixl", "--decode-nodes", "2", "--num-kv-blocks", "512") as (url, proc):
        yield url, proc


def test_client_disconnect_aborts_on_every_node(cluster):
    url, _ = cluster
    with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": "leave early", "stream": True, **LONG},
                      timeout=30) as resp:
        lines = resp.iter_lines()
        received = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: {") for line in received)
    wait_for(lambda: _all_blocks_free(url), timeout_s=15)


def test_dead_decode_node_ends_its_stream_and_the_other_takes_over(cluster):
    url, proc = cluster
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)
    stream = client.completions.create(model="builtin:tiny", prompt="stream until killed", stream=True,
                                       max_tokens=3000, temperature=0, extra_body={"ignore_eos": True})
    next(iter(stream))
    busy = wait_for(lambda: [n for n, s in node_stats(url).items() if s["role"] == "decode" and s["requests"]])
    os.kill(node_pids(proc.pid)[busy[0]], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass
    assert time.monotonic() - start < 15, "the stream should end soon after its node died"
    wait_for(lambda: not node_stats(url)[busy[0]]["healthy"])
    r = client.completions.create(model="builtin:tiny", prompt="still served", max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    wait_for(lambda: _all_blocks_free(url), timeout_s=15)


def test_dead_prefill_node_gives_503_not_a_hang(cluster):
    url, proc = cluster
    os.kill(node_pids(proc.pid)["prefill-0"], signal.SIGKILL)
    start = time.monotonic()
    resp = httpx.post(f"{url}/v1/completions", json={"prompt": "anyone there", "max_tokens": 4}, timeout=30)
    assert resp.status_code == 503 and resp.json()["error"]["message"]
    assert time.monotonic() - start < 10
    wait_for(lambda: httpx.get(f"{url}/health").status_code == 503)


def test_redis_death_falls_back_to_recompute():
    prompt = "the store is gone, " * 3
    want = LLM("builtin:tiny", num_kv_blocks=64).generate(
        prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    with running_cluster("--kv-transfer", "store") as (url, proc):
        os.kill(node_pids(proc.pid)["redis"], signal.SIGKILL)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        r = client.completions.create(model="builtin:tiny", prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == want
        wait_for(lambda: _all_blocks_free(url), timeout_s=15)
