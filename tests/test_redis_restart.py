"""Redis dies and comes back under a 1P1D store cluster: no request fails while it is down (the
prompt is recomputed, output unchanged), and once `pdserve up` has restarted it, new prompts'
blocks are written to it again."""
from __future__ import annotations

import os
import signal

import redis

from pdserve import LLM
from pdserve.testing.up_cluster import assert_greedy_matches_offline, node_pids, running_cluster, wait_for


def test_requests_survive_redis_death_and_reuse_it_once_back():
    llm = LLM("builtin:tiny", num_kv_blocks=256)
    with running_cluster("--kv-transfer", "store", "--prefill-nodes", "1", "--decode-nodes", "1",
                         "--num-kv-blocks", "256") as (url, proc):
        assert_greedy_matches_offline(url, llm, [(3 * i) % 200 + 20 for i in range(100)], 6)
        old = node_pids(proc.pid)["redis"]
        os.kill(old, signal.SIGKILL)
        for k in range(3):  # while Redis is down or just restarted: still served, still exact
            assert_greedy_matches_offline(url, llm, [(5 * i + k) % 200 + 20 for i in range(90)], 6)
        wait_for(lambda: node_pids(proc.pid).get("redis") not in (None, old), timeout_s=30)
        port = int(_redis_port(node_pids(proc.pid)["redis"]))
        redis.Redis(port=port).ping()
        before = redis.Redis(port=port).dbsize()
        assert_greedy_matches_offline(url, llm, [(11 * i) % 200 + 20 for i in range(128)], 6)
        # The prefill node writes the new prompt's 8 blocks to the restarted Redis.
        wait_for(lambda: redis.Redis(port=port).dbsize() >= before + 8, timeout_s=10)


def _redis_port(pid: int) -> str:
    import psutil
    cmd = psutil.Process(pid).cmdline()
    if "--port" in cmd:
        return cmd[cmd.index("--port") + 1]
    return next(a.rsplit(":", 1)[-1] for a in cmd if ":" in a)
