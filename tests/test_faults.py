"""Faults against a real cluster: a client that leaves and a Redis that dies. Nothing hangs and
no KV block stays allocated. (Dead prefill and decode nodes: tests/test_failover.py.)"""
from __future__ import annotations

import os
import signal

import httpx
import openai
import pytest

from pdserve import LLM, SamplingParams
from pdserve.testing.up_cluster import node_pids, node_stats, running_cluster, wait_for

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
