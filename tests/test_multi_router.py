"""Router replicas: `pdserve up --routers 2`, real processes over real sockets, the openai client.

  * both replicas list the same nodes and serve the offline engine's greedy output;
  * every node's KV events reach both: a prefix first served through replica A is routed to the
    prefill node holding it and is a cache hit (`cached_tokens`) for a request through replica B,
    and both replicas' prefix indexes agree;
  * SIGKILL of replica B under load: every stream through A completes with the same tokens, the
    nodes end B's (long) requests once B is silent and no KV block stays in use, and the
    launcher restarts B, which takes its nodes from the registry, rebuilds its index from the
    nodes' snapshots, and serves.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import threading

import httpx
import openai
import psutil
import pytest

from pdserve import LLM, SamplingParams
from pdserve.testing.up_cluster import assert_greedy_matches_offline, node_stats, running_cluster, wait_for

SHARED = list(range(3, 163))  # 10 blocks of 16 tokens
MAX_TOKENS = 32
LONG_TOKENS = 3900  # streams through the replica that dies: far longer than the test waits
ROUTER_GONE_S = 3.0


@pytest.fixture(scope="module")
def llm():
    return LLM("builtin:tiny", num_kv_blocks=512)


@pytest.fixture(scope="module")
def cluster():
    # Nodes end a silent router's requests after this long (10 s by default).
    os.environ["PDSERVE_ROUTER_GONE_S"] = str(ROUTER_GONE_S)
    try:
        with running_cluster("--kv-transfer", "nixl", "--prefill-nodes", "2", "--decode-nodes", "1",
                             "--routers", "2", "--num-kv-blocks", "512") as (url, proc):
            port = int(url.rsplit(":", 1)[1])
            replica = f"http://127.0.0.1:{port + 1}"
            wait_for(lambda: _healthy_nodes(replica) == 3, timeout_s=120)
            yield url, replica, proc
    finally:
        del os.environ["PDSERVE_ROUTER_GONE_S"]


def _healthy_nodes(url: str) -> int:
    try:
        return sum(n["healthy"] for n in node_stats(url).values())
    except httpx.HTTPError:
        return 0


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _complete(url: str, prompt: list[int], max_tokens: int = 8):
    return _client(url).completions.create(model="builtin:tiny", prompt=prompt, max_tokens=max_tokens,
                                           temperature=0, extra_body={"ignore_eos": True})


def _prefill_index(url: str) -> int:
    """The most blocks this router's prefix index credits to one prefill node (from KV events)."""
    return max(n["index_blocks"] for n in node_stats(url).values() if n["role"] == "prefill")


def test_both_replicas_serve_and_share_the_prefix_index(cluster, llm):
    url_a, url_b, _ = cluster
    assert node_stats(url_a).keys() == node_stats(url_b).keys()
    for url in (url_a, url_b):
        assert_greedy_matches_offline(url, llm, list(range(7, 50)), 12)
    first = _complete(url_a, SHARED + [200, 201, 202])
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # B learned from the prefill node's KV events where A's prefix went, so it routes there.
    wait_for(lambda: _prefill_index(url_b) >= len(SHARED) // 16)
    second = _complete(url_b, SHARED + [210, 211, 212, 213])
    assert second.usage.prompt_tokens_details.cached_tokens >= len(SHARED) - 16


def _router_pid(up_pid: int, port: int) -> int:
    for child in psutil.Process(up_pid).children():
        cmd = child.cmdline()
        if "router" in cmd and cmd[cmd.index("--port") + 1] == str(port):
            return child.pid
    raise AssertionError(f"no router on port {port}")


def _stream(url: str, prompt: list[int], started: threading.Event, max_tokens: int = MAX_TOKENS) -> list[int]:
    ids: list[int] = []
    stream = _client(url).completions.create(model="builtin:tiny", prompt=prompt, max_tokens=max_tokens, stream=True,
                                             temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    for chunk in stream:
        if chunk.choices:
            ids += chunk.choices[0].model_extra.get("token_ids") or []
            started.set()
    return ids


def test_a_killed_replica_costs_only_its_own_streams(cluster, llm):
    url_a, url_b, up = cluster
    port_b = int(url_b.rsplit(":", 1)[1])
    prompts = [list(range(10 + i, 60 + 5 * i)) for i in range(16)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]
    old_pid = _router_pid(up.pid, port_b)
    # Every stream through B has its first tokens before B dies: one that had not reached B yet
    # would be served by B's restarted process (a loaded host once ran it to the end that way).
    started = [threading.Event() for _ in prompts]
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(_stream, url_a, p, started[i]) if i % 2 == 0
                   else pool.submit(_stream, url_b, p, started[i], LONG_TOKENS) for i, p in enumerate(prompts)]
        assert all(event.wait(120) for event in started[1::2]), "a stream through B never started"
        os.kill(old_pid, signal.SIGKILL)
        results = [f.exception(timeout=300) or f.result() for f in futures]
    for i in range(0, len(prompts), 2):
        assert results[i] == want[i], f"stream {i} through the surviving replica"
    assert all(isinstance(r, Exception) for r in results[1::2]), "a stream outlived its router"
    # The nodes end the dead replica's requests (thousands of tokens each) once it is silent:
    # well before those could finish (slack for a loaded host, whose decoding slows as well).
    wait_for(lambda: all(n["kv_blocks_in_use"] == 0 and n["requests"] == 0 for n in node_stats(url_a).values()),
             timeout_s=ROUTER_GONE_S + 17)
    # The launcher restarts B; it finds the nodes in the registry and their caches in snapshots.
    wait_for(lambda: _healthy_nodes(url_b) == 3 and _router_pid(up.pid, port_b) != old_pid, timeout_s=120)
    wait_for(lambda: _prefill_index(url_b) >= len(SHARED) // 16, timeout_s=30)  # rebuilt from snapshots
    assert_greedy_matches_offline(url_b, llm, list(range(11, 64)), 12)
