"""Tensor parallelism over `pdserve up` (real processes, real sockets, the official openai
client): two clusters on one Redis store, prefill TP 2 / decode TP 1 and prefill TP 1 / decode
TP 2. Greedy output equals the offline engine; a prefix first prefilled by a TP 2 node is a
store hit (cached_tokens) for the TP 1 node of the other cluster, and the other way round (the
stored block bytes and keys do not depend on the TP degree). Then one worker of a TP 2 decode
node is SIGKILLed under greedy streams: no request is lost, the text is identical, the node
comes back, no process stays behind and no KV block stays in use. A third cluster hands KV over
NIXL from a TP 2 prefill node to a TP 1 decode node: greedy output equals the offline engine and
the decode node counts NIXL reads, no failure."""
from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import threading

import openai
import psutil
import pytest
from cluster_util import node_pids, node_stats, running_clusters, wait_for
from redis_util import redis_server

from pdserve import LLM, SamplingParams

SHORT = 8
# Long enough that every stream is still running when a worker is killed, on a fast machine too
# (CI once found no decode node busy any more at 160 tokens).
STREAM_LONG = 640


@pytest.fixture(scope="module")
def llm():
    return LLM("builtin:tiny", num_kv_blocks=256)


@pytest.fixture(scope="module")
def all_clusters():
    """All three started together (their start-up waits overlap): store 2/1, store 1/2, NIXL 2/1."""
    common = ("--kv-transfer", "store", "--num-kv-blocks", "256")
    with redis_server() as (redis_url, _), running_clusters(
            (*common, "--store", redis_url, "--prefill-tp", "2", "--decode-tp", "1"),
            (*common, "--store", redis_url, "--prefill-tp", "1", "--decode-tp", "2", "--decode-nodes", "2"),
            ("--kv-transfer", "nixl", "--num-kv-blocks", "256", "--prefill-tp", "2", "--decode-tp", "1"),
    ) as started:
        workers = {}
        for _, proc in started:
            for name, pid in node_pids(proc.pid).items():
                workers[name + f"@{proc.pid}"] = [c.pid for c in psutil.Process(pid).children()]
        yield started
    leftover = [p for pids in workers.values() for p in pids if _alive(p)]
    assert not leftover, f"TP workers left running after the clusters stopped: {leftover}"


@pytest.fixture(scope="module")
def clusters(all_clusters):
    return all_clusters[:2]


@pytest.fixture(scope="module")
def nixl_cluster(all_clusters):
    return all_clusters[2]


def _alive(pid: int) -> bool:
    return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=180)


def _complete(url: str, prompt: list[int], max_tokens: int):
    return _client(url).completions.create(model="builtin:tiny", prompt=prompt, max_tokens=max_tokens,
                                           temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})


def _offline(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                             use_tqdm=False)]


def test_nodes_report_their_tp_degree(clusters):
    (url_a, _), (url_b, _) = clusters
    degrees = {(n["role"], n["tensor_parallel_size"]) for url in (url_a, url_b) for n in node_stats(url).values()}
    assert degrees == {("prefill", 2), ("decode", 1), ("prefill", 1), ("decode", 2)}


@pytest.mark.parametrize("first,then", [(0, 1), (1, 0)], ids=["tp2-then-tp1", "tp1-then-tp2"])
def test_greedy_equals_offline_and_prefix_hits_across_degrees(clusters, llm, first, then):
    urls = [url for url, _ in clusters]
    prompt = [(17 * i + 3 * first + 5) % 250 + 3 for i in range(96)]
    want = _offline(llm, [prompt], SHORT)[0]
    a = _complete(urls[first], prompt, SHORT)
    assert a.choices[0].model_extra["token_ids"] == want
    assert (a.usage.prompt_tokens_details.cached_tokens or 0) == 0  # nobody had it yet
    b = _complete(urls[then], prompt, SHORT)
    assert b.choices[0].model_extra["token_ids"] == want
    assert b.usage.prompt_tokens_details.cached_tokens >= 64, "the other degree's stored prefix was not a hit"


def test_nixl_handover_from_tp2_prefill_to_tp1_decode(nixl_cluster, llm):
    url, _ = nixl_cluster
    stats = node_stats(url)
    assert {(n["role"], n["tensor_parallel_size"]) for n in stats.values()} == {("prefill", 2), ("decode", 1)}
    prompts = [[(13 * i + 11 * k) % 250 + 3 for i in range(40 + 24 * k)] for k in range(3)]
    want = _offline(llm, prompts, SHORT)
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: _complete(url, p, SHORT).choices[0].model_extra["token_ids"], prompts))
    assert got == want
    # The decode node pulled every prompt's blocks over NIXL (stats reach the router with its pings).
    decode = next(name for name, n in stats.items() if n["role"] == "decode")
    wait_for(lambda: node_stats(url)[decode]["transfers_ok"] >= len(prompts), timeout_s=30)
    after = node_stats(url)[decode]
    assert after["transfers_failed"] == 0 and after["transfer_bytes_nixl"] > 0


def test_decode_worker_killed_under_streams_loses_nothing(clusters, llm):
    url, proc = clusters[1]  # decode TP 2
    prompts = [[(29 * i + 7 * k) % 250 + 3 for i in range(20 + 3 * k)] for k in range(4)]
    want = _offline(llm, prompts, STREAM_LONG)
    client = _client(url)
    started = threading.Event()
    nodes = node_pids(proc.pid)
    victims = {name: psutil.Process(pid).children() for name, pid in nodes.items() if name.startswith("decode")}

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
        assert started.wait(120)
        # The router's own count is current; wait_for only rides out a health call that races a step.
        name = wait_for(lambda: next((n for n, s in node_stats(url).items()
                                      if s["role"] == "decode" and s["routed_requests"]), None), timeout_s=10)
        worker = victims[name][0]
        os.kill(worker.pid, signal.SIGKILL)
        got = [f.result() for f in futures]  # a lost request raises here
    assert got == want
    # The node went down with its worker, and its other processes too; its owner restarted it.
    _, alive = psutil.wait_procs([psutil.Process(nodes[name])] if _alive(nodes[name]) else [], timeout=30)
    assert not alive
    assert not [p.pid for p in victims[name] if _alive(p.pid)]
    wait_for(lambda: node_pids(proc.pid).get(name, nodes[name]) != nodes[name], timeout_s=30)
    wait_for(lambda: node_stats(url).get(name, {}).get("healthy"), timeout_s=180)
    wait_for(lambda: all(s["free_blocks"] == s["total_blocks"] and s["requests"] == 0
                         for s in node_stats(url).values() if s["healthy"]), timeout_s=30)
