"""Pipeline parallelism over `pdserve up` (real processes, real sockets, the official openai
client), with KV handed over between nodes of different PP degrees.

Two clusters, one handing KV over through the store and one over NIXL, each with prefill-0 at
PP 2 and prefill-1 at PP 1 (`--prefill-pp 2,1`), decode-0 at PP 1 and decode-1 at PP 2
(`--decode-pp 1,2`), routed round robin, so consecutive requests pair prefill PP 2 with decode
PP 1 and prefill PP 1 with decode PP 2. Each request's serving nodes are read from their own
request counters (test_tp_cluster's helpers), so each pair is asserted as served:

  * greedy output equals the offline engine's (which other tests tie to transformers) for
    prefill/decode PP 2/1 and 1/2, over the store and over NIXL, with no failed transfer;
  * a prefix first computed by the PP 2 prefill node is loaded from the store by the PP 1 node,
    and the other way round;
  * one stage of the PP 2 decode node is SIGKILLed under 8 greedy streams: no request is lost,
    the text is identical, the node comes back, no process stays behind, and no KV block stays
    in use.
"""
from __future__ import annotations

import psutil
import pytest
from test_tp_cluster import SHORT, _alive, _offline, _prompt, _serve, kill_a_worker_under_streams

from pdserve import LLM
from pdserve.testing.up_cluster import node_pids, node_stats, running_clusters, wait_for

PP_POOLS = ("--num-kv-blocks", "256", "--prefill-nodes", "2", "--prefill-pp", "2,1", "--decode-nodes", "2",
            "--decode-pp", "1,2", "--prefill-policy", "round_robin", "--decode-policy", "round_robin")
STAGES = {"prefill-0": 2, "prefill-1": 1, "decode-0": 1, "decode-1": 2}
ACROSS_DEGREES = {(2, 1), (1, 2)}  # (prefill PP, decode PP)
MAX_REQUESTS = 8


@pytest.fixture(scope="module")
def llm():
    return LLM("builtin:tiny", num_kv_blocks=512)


@pytest.fixture(scope="module")
def clusters():
    with running_clusters(("--kv-transfer", "store", *PP_POOLS), ("--kv-transfer", "nixl", *PP_POOLS)) as started:
        workers = [c.pid for _, proc in started for pid in node_pids(proc.pid).values()
                   for c in psutil.Process(pid).children()]
        yield dict(zip(("store", "nixl"), started))
    leftover = [p for p in workers if _alive(p)]
    assert not leftover, f"stage workers left running after the clusters stopped: {leftover}"


@pytest.mark.parametrize("transfer", ["store", "nixl"])
def test_handover_across_pp_degrees_equals_offline(clusters, llm, transfer):
    url, _ = clusters[transfer]
    assert {n: s["pipeline_parallel_size"] for n, s in node_stats(url).items()} == STAGES
    before = node_stats(url)
    prompts = [_prompt(300 + k, 40 + 8 * k) for k in range(MAX_REQUESTS)]
    served = set()
    for prompt, want in zip(prompts, _offline(llm, prompts, SHORT)):
        s = _serve(url, prompt)
        pair = (STAGES[s.prefill], STAGES[s.decode])
        assert s.token_ids == want, f"prefill/decode PP {pair[0]}/{pair[1]}"
        served.add(pair)
        if ACROSS_DEGREES <= served:
            break
    assert ACROSS_DEGREES <= served, f"only these (prefill PP, decode PP) pairs served: {served}"
    # A node's counters reach the router with its pongs, and a pong can carry the request count
    # before the transfer count: wait for the pong that has both.
    now = wait_for(lambda: _pulled_since(url, before, transfer), timeout_s=30)
    assert all(s.get("transfers_failed", 0) == 0 for s in now.values())


def _pulled_since(url: str, before: dict[str, dict], transfer: str) -> dict[str, dict] | None:
    now = node_stats(url)
    pulled = all(now[n]["transfers_ok"] > before[n]["transfers_ok"] and now[n][f"transfer_bytes_{transfer}"] > 0
                 for n in ("decode-0", "decode-1"))
    return now if pulled else None


def test_prefix_hits_across_pp_degrees_through_the_store(clusters, llm):
    """A prompt first computed at one prefill degree, then sent again until the other degree's
    prefill node serves it: that node loads its prefix from the store. Both directions."""
    url, _ = clusters["store"]
    first: dict[int, int] = {}
    hits = {}
    want = dict(enumerate(_offline(llm, [_prompt(400 + i) for i in range(MAX_REQUESTS)], SHORT), start=400))
    for _ in range(2 * MAX_REQUESTS):
        waiting = [seed for seed, d in first.items() if (d, 3 - d) not in hits]
        seed = waiting[0] if waiting else 400 + len(first)
        s = _serve(url, _prompt(seed))
        assert s.token_ids == want[seed]
        stages = STAGES[s.prefill]
        if seed not in first:
            first[seed] = stages
        elif stages != first[seed]:
            hits[(first[seed], stages)] = s
        if len(hits) == 2:
            break
    assert hits.keys() == {(2, 1), (1, 2)}, f"served at: {first}, hits: {list(hits)}"
    for (a, b), s in hits.items():
        assert s.store_loaded >= 64, f"the PP {b} prefill node did not load the PP {a} node's prefix from the store"


def test_decode_stage_killed_under_streams_loses_nothing(clusters, llm):
    kill_a_worker_under_streams(*clusters["store"], "decode-1", STAGES["decode-1"], llm)  # stage 1 of the PP 2 node
