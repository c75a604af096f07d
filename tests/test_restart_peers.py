"""Peers that come back: a prefill node, then a decode node, SIGKILLed and restarted by `pdserve
up` on the same addresses (a new process, a new NIXL agent under the old name, new memory
registrations). Afterwards every handover still goes over NIXL (the decode node READs from the
new agent, not a stale one), no READ fails, the prefill node frees each request's pinned blocks
on the decode node's notification rather than at the lease's end, and the text is the offline
engine's."""
from __future__ import annotations

import os
import signal

import openai
import pytest

from pdserve import LLM, SamplingParams
from pdserve.testing.up_cluster import node_pids, node_stats, running_cluster, wait_for

MODEL = "builtin:tiny"
LEASE_S = 300  # far past the test: blocks freed here were freed by the notification


@pytest.fixture(scope="module")
def cluster():
    with running_cluster("--kv-transfer", "nixl", "--prefill-nodes", "1", "--decode-nodes", "1",
                         "--num-kv-blocks", "256", "--lease-s", str(LEASE_S)) as (url, proc):
        yield url, proc


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, num_kv_blocks=256)


def _round(url: str, llm: LLM, tag: str, n: int = 3) -> None:
    """n greedy requests, each handed over by NIXL: text as offline, blocks free again."""
    prompts = [f"{tag} {i}: a peer that comes back is paired anew. " * 2 for i in range(n)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    got = [client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
    assert got == want
    wait_for(lambda: all(s.get("kv_blocks_in_use") == 0 for s in node_stats(url).values()), timeout_s=10)


def _restart(url: str, proc, name: str) -> None:
    old = node_pids(proc.pid)[name]
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: node_pids(proc.pid).get(name, old) != old, timeout_s=30)
    wait_for(lambda: node_stats(url).get(name, {}).get("healthy"), timeout_s=120)


def _transfers(url: str) -> tuple[int, int]:
    decode = node_stats(url)["decode-0"]
    return decode["transfers_ok"], decode["transfers_failed"]


def _wait_transfers(url: str, want: tuple[int, int]) -> None:
    """Counters ride on pongs every 0.2 s, and a pong from before the round's last handover still
    shows fewer: wait for the round's counts (a failed READ would never reach them)."""
    try:
        wait_for(lambda: _transfers(url) == want, timeout_s=10)
    except AssertionError:
        raise AssertionError(f"decode-0 transfers (ok, failed): {_transfers(url)}, want {want}") from None


def test_a_restarted_prefill_node_is_read_through_its_new_agent(cluster, llm):
    url, proc = cluster
    _round(url, llm, "before")
    _wait_transfers(url, (3, 0))
    _restart(url, proc, "prefill-0")
    _round(url, llm, "after the prefill restart")
    _wait_transfers(url, (6, 0))  # every handover READ from the new agent
    assert node_stats(url)["prefill-0"]["leases_expired"] == 0


def test_a_restarted_decode_node_notifies_the_prefill_node(cluster, llm):
    url, proc = cluster
    _restart(url, proc, "decode-0")
    _round(url, llm, "after the decode restart")
    _wait_transfers(url, (3, 0))  # the new process's counters
    assert node_stats(url)["prefill-0"]["leases_expired"] == 0
