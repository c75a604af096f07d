"""Tensor parallelism over `pdserve up` (real processes, real sockets, the official openai
client), with KV handed over between nodes of different TP degrees.

Two clusters, one handing KV over through the store (its own redis-server) and one over NIXL,
each with mixed pools: prefill nodes at TP 1 and 2 (`--prefill-tp 1,2`), decode nodes at TP 1,
2 and 1 (`--decode-nodes 3 --decode-tp 1,2`), both routed round robin. Pools of 2 and 3 nodes
make consecutive requests walk through every (prefill, decode) pair of nodes, so one cluster per
transport serves each pair of degrees: 1/1, 1/2, 2/1 and 2/2. Each request's serving nodes are
read from their own request counters, so every pair is asserted as served, not assumed:

  * greedy output equals the offline engine (which other tests tie to transformers) for prefill
    and decode TP 2/1, 1/2 and 2/2, over the store and over NIXL, and every decode node pulled
    its prompts' KV (no failed transfer, no decode node prefilling by itself);
  * a prefix first computed by the TP 2 prefill node is loaded from the store (cached_tokens, and
    the TP 1 node's own count of tokens loaded from the store) by the TP 1 prefill node, and the
    other way round: the stored block bytes and keys do not depend on the TP degree;
  * one worker of the TP 2 decode node is SIGKILLed under 8 greedy streams: no request is lost,
    the text is identical, the node comes back, no process stays behind, and no KV block stays
    in use.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import threading
from dataclasses import dataclass

import httpx
import openai
import psutil
import pytest

from pdserve import LLM, SamplingParams
from pdserve.testing.up_cluster import node_pids, node_stats, running_clusters, wait_for

SHORT = 8
# Long enough that streams still run when a worker is killed, on a fast machine too (CI once
# found no decode node busy any more at 160 tokens); the test asserts that streams did move.
STREAM_LONG = 640
STREAMS = 8
# Prefill nodes at TP 1 and 2, decode nodes at TP 1, 2 and 1; 2 and 3 nodes: round robin pairs
# every prefill node with every decode node within 6 requests.
MIXED = ("--num-kv-blocks", "256", "--prefill-nodes", "2", "--prefill-tp", "1,2", "--decode-nodes", "3",
         "--decode-tp", "1,2", "--prefill-policy", "round_robin", "--decode-policy", "round_robin")
DEGREES = {"prefill-0": 1, "prefill-1": 2, "decode-0": 1, "decode-1": 2, "decode-2": 1}
ACROSS_DEGREES = {(2, 1), (1, 2), (2, 2)}  # (prefill TP, decode TP) pairs the issue asks for
MAX_REQUESTS = 12  # round robin needs at most 6; a node briefly out of rotation may cost a few more


@pytest.fixture(scope="module")
def llm():
    return LLM("builtin:tiny", num_kv_blocks=512)  # the 8 long streams at once


@pytest.fixture(scope="module")
def all_clusters():
    """Both started together (their start-up waits overlap): over the store, and over NIXL."""
    with running_clusters(("--kv-transfer", "store", *MIXED), ("--kv-transfer", "nixl", *MIXED)) as started:
        workers = {}
        for _, proc in started:
            for name, pid in node_pids(proc.pid).items():
                workers[name + f"@{proc.pid}"] = [c.pid for c in psutil.Process(pid).children()]
        yield started
    leftover = [p for pids in workers.values() for p in pids if _alive(p)]
    assert not leftover, f"TP workers left running after the clusters stopped: {leftover}"


@pytest.fixture(scope="module")
def store_cluster(all_clusters):
    return all_clusters[0]


@pytest.fixture(scope="module")
def nixl_cluster(all_clusters):
    return all_clusters[1]


def _alive(pid: int) -> bool:
    return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=180)


def _offline(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                             use_tqdm=False)]


def _failover(url: str) -> dict[str, int]:
    """The router's counters of prefill retries, decode resumes and prompts prefilled on a decode node
    (after a failure); not placed_local/placed_remote, which count every planned placement."""
    counters = httpx.get(f"{url}/health", timeout=10).json()["failover"]
    return {k: v for k, v in counters.items() if not k.startswith("placed_")}


def _prompt(seed: int, length: int = 96) -> list[int]:
    return [(17 * i + 31 * seed + 5) % 250 + 3 for i in range(length)]


@dataclass
class Served:
    token_ids: list[int]
    cached_tokens: int  # the usage's prompt_tokens_details.cached_tokens
    prefill: str        # the nodes that served it, from their own request counters
    decode: str
    store_loaded: int   # prompt tokens its prefill node loaded from the store for it


def _serve(url: str, prompt: list[int]) -> Served:
    """One greedy completion, and which prefill and decode node served it: the one node of each
    role whose request count grew (counts reach the router with the nodes' pongs)."""
    before = node_stats(url)
    r = _client(url).completions.create(model="builtin:tiny", prompt=prompt, max_tokens=SHORT, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})

    def grown():
        now = node_stats(url)
        grew = {n: s.get("requests_total", 0) - before.get(n, {}).get("requests_total", 0) for n, s in now.items()}
        by_role = {role: [n for n, d in grew.items() if d and now[n]["role"] == role] for role in ("prefill", "decode")}
        if [sum(grew[n] for n in nodes) for nodes in by_role.values()] == [1, 1]:
            return now, by_role["prefill"][0], by_role["decode"][0]
        return None

    now, prefill, decode = wait_for(grown, timeout_s=30, interval_s=0.05)
    loaded = now[prefill]["cached_tokens_store"] - before[prefill]["cached_tokens_store"]
    return Served(r.choices[0].model_extra["token_ids"], r.usage.prompt_tokens_details.cached_tokens or 0,
                  prefill, decode, loaded)


def _serve_every_pair(url: str, llm: LLM, seed: int) -> dict[str, int]:
    """Fresh prompts, one at a time, until the pairs of degrees in ACROSS_DEGREES have each served
    one; every greedy output equals the offline engine's. Returns the requests per decode node."""
    served, per_decode = set(), {}
    prompts = [_prompt(seed + k, 40 + 8 * k) for k in range(MAX_REQUESTS)]
    want = _offline(llm, prompts, SHORT)  # one batch: cheaper than one generate per request
    for prompt, expected in zip(prompts, want):
        s = _serve(url, prompt)
        pair = (DEGREES[s.prefill], DEGREES[s.decode])
        assert s.token_ids == expected, f"prefill/decode TP {pair[0]}/{pair[1]}"
        served.add(pair)
        per_decode[s.decode] = per_decode.get(s.decode, 0) + 1
        if ACROSS_DEGREES <= served:
            return per_decode
    raise AssertionError(f"only these (prefill TP, decode TP) pairs served in {MAX_REQUESTS} requests: {served}")


def _handovers_across_degrees(url: str, llm: LLM, seed: int) -> dict[str, int]:
    """_serve_every_pair, then: each decode node pulled the KV of every request it served, none
    failed, and no prompt was prefilled on a decode node or retried."""
    before, failover = node_stats(url), _failover(url)
    per_decode = _serve_every_pair(url, llm, seed)

    def pulled() -> bool:
        now = node_stats(url)
        return all(now[n]["transfers_ok"] - before[n]["transfers_ok"] >= count for n, count in per_decode.items())
    wait_for(pulled, timeout_s=30)
    assert all(s.get("transfers_failed", 0) == 0 for s in node_stats(url).values())
    assert _failover(url) == failover
    return per_decode


@pytest.mark.parametrize("which", ["store", "nixl"])
def test_nodes_report_their_tp_degree(all_clusters, which):
    url, _ = all_clusters[["store", "nixl"].index(which)]
    assert {n: s["tensor_parallel_size"] for n, s in node_stats(url).items()} == DEGREES
    admin = httpx.get(f"{url}/admin/nodes", timeout=10).json()
    assert {n["id"]: n["tensor_parallel_size"] for n in admin["nodes"]} == DEGREES


def test_store_handover_across_degrees_equals_offline(store_cluster, llm):
    url, _ = store_cluster
    per_decode = _handovers_across_degrees(url, llm, seed=0)
    assert all(node_stats(url)[n]["transfer_bytes_store"] > 0 for n in per_decode)


def test_nixl_handover_across_degrees_equals_offline(nixl_cluster, llm):
    url, _ = nixl_cluster
    per_decode = _handovers_across_degrees(url, llm, seed=100)
    assert all(node_stats(url)[n]["transfer_bytes_nixl"] > 0 for n in per_decode)


def test_prefix_hits_across_degrees_through_the_store(store_cluster, llm):
    """A prompt first computed at one prefill degree, then sent again until the other degree's
    prefill node serves it: that node loads its prefix from the store. Both directions."""
    url, _ = store_cluster
    first: dict[int, int] = {}  # prompt seed -> the prefill degree that computed it first
    hits: dict[tuple[int, int], Served] = {}  # (first degree, then degree) -> the request that hit
    want = dict(enumerate(_offline(llm, [_prompt(200 + i) for i in range(MAX_REQUESTS)], SHORT), start=200))
    for _ in range(MAX_REQUESTS):
        waiting = [seed for seed, d in first.items() if (d, 3 - d) not in hits]
        seed = waiting[0] if waiting else 200 + len(first)
        s = _serve(url, _prompt(seed))
        assert s.token_ids == want[seed]
        degree = DEGREES[s.prefill]
        if seed not in first:
            first[seed] = degree
            assert s.cached_tokens == 0 and s.store_loaded == 0, "nobody had this prompt yet"
        elif degree != first[seed]:
            hits[(first[seed], degree)] = s
        if len(hits) == 2:
            break
    assert hits.keys() == {(2, 1), (1, 2)}, f"served at: {first}, hits: {list(hits)}"
    for (a, b), s in hits.items():
        assert s.store_loaded >= 64, f"the TP {b} prefill node did not load the TP {a} node's prefix from the store"
        assert s.cached_tokens >= 64


def test_decode_worker_killed_under_streams_loses_nothing(store_cluster, llm):
    kill_a_worker_under_streams(*store_cluster, "decode-1", DEGREES["decode-1"], llm)  # the TP 2 decode node


def kill_a_worker_under_streams(url: str, proc, name: str, ranks: int, llm) -> None:
    """SIGKILL one worker process (rank 1) of node `name` under STREAMS greedy streams: every
    stream's text equals the offline engine's, the streams resumed elsewhere, the node went down
    with all its processes and came back, and every node's blocks return to free. Shared with the
    pipeline-parallel cluster test (a stage's worker)."""
    prompts = [[(29 * i + 7 * k) % 250 + 3 for i in range(20 + 3 * k)] for k in range(STREAMS)]
    want = _offline(llm, prompts, STREAM_LONG)
    client = _client(url)
    started = threading.Event()
    node_pid = node_pids(proc.pid)[name]
    workers = psutil.Process(node_pid).children()
    assert len(workers) == ranks - 1
    resumes_before = _failover(url)["decode_resumes"]

    def stream(prompt):
        ids = []
        for chunk in client.completions.create(model="builtin:tiny", prompt=prompt, max_tokens=STREAM_LONG,
                                               stream=True, temperature=0,
                                               extra_body={"ignore_eos": True, "return_token_ids": True}):
            if chunk.choices:
                ids += chunk.choices[0].model_extra.get("token_ids") or []
                if len(ids) >= 10:
                    started.set()
        return ids

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream, p) for p in prompts]
        assert started.wait(180)
        # The router's own count is current; wait_for only rides out a health call that races a step.
        wait_for(lambda: node_stats(url)[name]["routed_requests"], timeout_s=10)
        os.kill(workers[0].pid, signal.SIGKILL)
        got = [f.result(timeout=540) for f in futures]  # a lost request raises here
    assert got == want
    # Streams were running on the node that went down, and resumed elsewhere.
    assert _failover(url)["decode_resumes"] > resumes_before
    # The node went down with its worker, and its other processes too; its owner restarted it.
    _, alive = psutil.wait_procs([psutil.Process(node_pid)] if _alive(node_pid) else [], timeout=30)
    assert not alive
    assert not [p.pid for p in workers if _alive(p.pid)]
    wait_for(lambda: node_pids(proc.pid).get(name, node_pid) != node_pid, timeout_s=30)
    wait_for(lambda: node_stats(url).get(name, {}).get("healthy"), timeout_s=180)
    wait_for(lambda: all(s["free_blocks"] == s["total_blocks"] and s["requests"] == 0
                         for s in node_stats(url).values() if s["healthy"]), timeout_s=30)
