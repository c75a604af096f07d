"""A Redis that closes idle connections (`timeout` in its config, which managed Redis services
set): the nodes' connections to it are cut while the cluster sits idle, and the next handover
through the store must still go through Redis, first time, with the offline engine's output:
no failed transfer, no recompute."""
from __future__ import annotations

import time

import pytest
import redis

from pdserve import LLM
from pdserve.testing.redis_server import redis_server
from pdserve.testing.up_cluster import assert_greedy_matches_offline, node_stats, running_cluster, wait_for

IDLE_TIMEOUT_S = 1


def _clients(url: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        return len(client.client_list()) - 1  # not this one
    finally:
        client.close()


def _stored_and_loaded(cluster: str, before: dict) -> dict | None:
    """The node stats once the prefill node has put blocks in the store and the decode node has
    read them since `before`; None until then."""
    stats = node_stats(cluster)
    grew = all(stats[node]["transfer_bytes_store"] > before[node]["transfer_bytes_store"]
               for node in ("prefill-0", "decode-0"))
    return stats if grew else None


@pytest.mark.parametrize("scheme", ["redis://", "direct+redis://"])
def test_handovers_go_through_a_redis_that_closed_the_idle_connections(scheme):
    llm = LLM("builtin:tiny", num_kv_blocks=256)
    with redis_server(extra_args=["--timeout", str(IDLE_TIMEOUT_S)]) as (url, _):
        store = url.replace("redis://", scheme)
        with running_cluster("--kv-transfer", "store", "--store", store, "--prefill-nodes", "1",
                             "--decode-nodes", "1", "--num-kv-blocks", "256") as (cluster, _):
            busy = []
            for round_ in range(2):
                before = node_stats(cluster)
                prompt = [(13 * i + 7 * round_) % 200 + 20 for i in range(70 + round_)]
                assert_greedy_matches_offline(cluster, llm, prompt, 8)
                # Node stats come with pongs (every 0.2 s), and a pong sent while the request ran
                # can be the newest one here: wait for one with both ends' store bytes counted.
                after = wait_for(lambda b=before: _stored_and_loaded(cluster, b), timeout_s=10)
                for node in ("prefill-0", "decode-0"):
                    assert after[node]["transfers_failed"] == 0, (round_, node, after[node])
                # Idle past Redis' timeout: it drops every connection the nodes left idle.
                busy.append(_clients(url))
                time.sleep(IDLE_TIMEOUT_S + 1.5)
                assert _clients(url) == 0, "Redis kept an idle connection: the next round would test nothing"
            assert max(busy) > 0, "the nodes never held a connection to Redis"
