"""The store is the cluster-wide tier: a prompt written to Redis by a prefill node is reused by
that node's next life after a SIGKILL and restart (its local cache is gone), and the output is
the offline engine's."""
from __future__ import annotations

import os
import signal

from cluster_util import assert_greedy_matches_offline, node_pids, node_stats, running_cluster, wait_for
from pdserve import LLM


def test_prefill_restart_between_writer_and_reader_still_reuses_the_store():
    prefix = [(7 * i) % 200 + 20 for i in range(160)]
    llm = LLM("builtin:tiny", num_kv_blocks=256)
    with running_cluster("--kv-transfer", "store", "--prefill-nodes", "1", "--decode-nodes", "1",
                         "--num-kv-blocks", "256") as (url, proc):
        assert_greedy_matches_offline(url, llm, prefix + [30, 31, 32], 8)
        old = node_pids(proc.pid)["prefill-0"]
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: node_pids(proc.pid).get("prefill-0") not in (None, old), timeout_s=30)
        wait_for(lambda: node_stats(url)["prefill-0"]["healthy"], timeout_s=60)
        assert_greedy_matches_offline(url, llm, prefix + [40, 41, 42, 43], 8)
        # The new process computed only the tail: its 160-token prefix came from Redis.
        wait_for(lambda: node_stats(url)["prefill-0"]["cached_tokens_store"] >= 160, timeout_s=10)
