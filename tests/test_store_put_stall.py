"""A store that stalls under a handover: with Redis stopped (SIGSTOP), the prefill node's put of a
prompt's blocks waits on it (the digest ledger's socket timeout, 2 s). The put runs off the
node's loop (pdserve/node/store_puts.py), so the node keeps answering the router's pings and
stays in rotation the whole time; the request still completes with the offline engine's tokens
(the decode node recomputes what the failed put did not write), and once Redis wakes the next
handover goes through the store again. Before, the node sent no pong while the put waited and the
router took it out of rotation after 1.5 s."""
from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time

from pdserve import LLM
from pdserve.testing.up_cluster import assert_greedy_matches_offline, node_pids, node_stats, running_cluster, wait_for

STALL_S = 3.5


def _prompt(seed: int) -> list[int]:
    return [(17 * i + seed) % 200 + 20 for i in range(90)]


def test_a_stalled_store_put_does_not_take_the_prefill_node_out_of_rotation():
    llm = LLM("builtin:tiny", num_kv_blocks=256)
    with running_cluster("--kv-transfer", "store", "--prefill-nodes", "1", "--decode-nodes", "1",
                         "--num-kv-blocks", "256") as (url, proc):
        assert_greedy_matches_offline(url, llm, _prompt(1), 8)
        redis_pid = node_pids(proc.pid)["redis"]
        healthy = []
        os.kill(redis_pid, signal.SIGSTOP)
        try:
            with cf.ThreadPoolExecutor(1) as pool:
                request = pool.submit(assert_greedy_matches_offline, url, llm, _prompt(2), 8)
                end = time.monotonic() + STALL_S
                while time.monotonic() < end:
                    healthy.append(node_stats(url)["prefill-0"]["healthy"])
                    time.sleep(0.1)
                os.kill(redis_pid, signal.SIGCONT)
                request.result(timeout=120)
        finally:
            os.kill(redis_pid, signal.SIGCONT)
        assert all(healthy), f"the prefill node left the rotation while its put waited: {healthy}"
        before = wait_for(lambda: node_stats(url))["decode-0"]["transfer_bytes_store"]
        assert_greedy_matches_offline(url, llm, _prompt(3), 8)
        wait_for(lambda: node_stats(url)["decode-0"]["transfer_bytes_store"] > before)  # the store serves again
        wait_for(lambda: all(s["free_blocks"] == s["total_blocks"] for s in node_stats(url).values()))
