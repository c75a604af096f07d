"""The store is the cluster-wide tier: a prompt written to Redis by a prefill node is reused by
that node's next life after a SIGKILL and restart (its local cache is gone), and the output is
the offline engine's."""
from __future__ import annotations

import os
import signal

import httpx
import psutil
import pytest
import redis

from pdserve import LLM
from pdserve.testing.up_cluster import assert_greedy_matches_offline, node_pids, node_stats, running_cluster, wait_for


@pytest.fixture(scope="module")
def llm():
    """The offline engine the outputs are checked against, one for the module's five clusters (a
    prefix cached from an earlier test changes no output): about 3 s of CPU a build saved."""
    return LLM("builtin:tiny", num_kv_blocks=256)


@pytest.mark.parametrize("store", ["default", "32-token chunks", "LMCache config file"])
def test_prefill_restart_between_writer_and_reader_still_reuses_the_store(store, tmp_path, llm):
    """default: 256-token chunks, so this 163-token prompt is all tail (direct Redis, block by
    block); with 32-token chunks (a flag, or chunk_size in an LMCache config file) its 160-token
    prefix is 5 LMCache chunks read over resp://."""
    prefix = [(7 * i) % 200 + 20 for i in range(160)]
    config = tmp_path / "lmcache.yaml"
    config.write_text("chunk_size: 32\nlocal_cpu: true\nmax_local_cpu_size: 0.05\n")
    flags = {"default": [], "32-token chunks": ["--store-chunk-tokens", "32"],
             "LMCache config file": ["--lmcache-config", str(config)]}[store]
    with running_cluster("--kv-transfer", "store", "--prefill-nodes", "1", "--decode-nodes", "1",
                         "--num-kv-blocks", "256", *flags) as (url, proc):
        assert_greedy_matches_offline(url, llm, prefix + [30, 31, 32], 8)
        old = node_pids(proc.pid)["prefill-0"]
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: node_pids(proc.pid).get("prefill-0") not in (None, old), timeout_s=30)
        wait_for(lambda: node_stats(url).get("prefill-0", {}).get("healthy"), timeout_s=60)  # absent until it re-registers
        assert_greedy_matches_offline(url, llm, prefix + [40, 41, 42, 43], 8)
        # The new process computed only the tail: its 160-token prefix came from Redis.
        wait_for(lambda: node_stats(url)["prefill-0"]["cached_tokens_store"] >= 160, timeout_s=10)
        port = _redis_port(proc.pid)
        chunks = [n for n in redis.Redis(port=port).scan_iter() if not n.startswith((b"pdkv:", b"pdkv-digest:"))]
        assert len(chunks) == (0 if store == "default" else 5), chunks


@pytest.mark.parametrize("scheme", ["direct+redis://", "redis://"])
def test_flipped_bytes_in_the_store_are_caught_counted_and_recomputed(scheme, llm):
    """A byte flipped in every stored value (direct Redis: its checksum; the LMCache store's
    32-token chunks: the digest ledger) is rejected by the reader, counted in /metrics, and the
    prompt is recomputed: the output is still the offline engine's."""
    prefix = [(11 * i) % 200 + 20 for i in range(160)]
    with running_cluster("--kv-transfer", "store", "--store", scheme, "--store-chunk-tokens", "32",
                         "--prefill-nodes", "1", "--decode-nodes", "1", "--num-kv-blocks", "256") as (url, proc):
        assert_greedy_matches_offline(url, llm, prefix + [30, 31, 32], 8)
        raw = redis.Redis(port=_redis_port(proc.pid))
        flipped = chunks = 0
        for name in raw.scan_iter():
            if name.startswith(b"pdkv-digest:"):
                continue
            value = raw.get(name)
            raw.setrange(name, len(value) - 3, bytes([value[-3] ^ 0x10]))
            flipped += 1
            chunks += not name.startswith(b"pdkv:")  # an LMCache chunk value
        assert flipped >= 6 and (chunks >= 5 if scheme == "redis://" else chunks == 0)
        old = node_pids(proc.pid)["prefill-0"]  # a fresh prefill node must read the store
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: node_pids(proc.pid).get("prefill-0") not in (None, old), timeout_s=30)
        wait_for(lambda: node_stats(url).get("prefill-0", {}).get("healthy"), timeout_s=60)  # absent until it re-registers
        assert_greedy_matches_offline(url, llm, prefix + [40, 41, 42, 43], 8)
        wait_for(lambda: node_stats(url)["prefill-0"].get("integrity_failures", 0) >= 1, timeout_s=10)
        assert node_stats(url)["prefill-0"]["cached_tokens_store"] == 0  # nothing corrupt was used
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        assert any('reason="digest_mismatch"' in line and 'node="prefill-0"' in line and float(line.split()[-1]) >= 1
                   for line in metrics.splitlines() if not line.startswith("#"))


def _redis_port(cluster_pid: int) -> int:
    redis_proc = psutil.Process(node_pids(cluster_pid)["redis"])
    (port,) = {c.laddr.port for c in redis_proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    return port
