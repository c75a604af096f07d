"""The node registry kept in Redis (`--registry redis://...`), on a real redis-server, real node
and router processes and real sockets; no registry process and no `pdserve up`.

A router given only `--registry redis://` serves through the nodes it finds there. A decode node
started by hand afterwards joins its rotation and serves (greedy output equal to the offline
engine's); a clean exit deletes the node's record, so it leaves at once; a SIGKILLed node's record
outlives it until its TTL, then the router drops it. In-process: a Redis outage longer than the
TTL and a Redis restart keep the router's nodes while the nodes write their records again, and
rediss:// with a password and a CA file carries the registry with the server's certificate checked.
"""
from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from urllib.parse import quote

import httpx
import msgspec
import pytest
import redis
from registry_util import serves, start_decode, stop_process, terminate_process, watch_pool
from test_redis_security import make_certs

from pdserve import LLM
from pdserve.cluster.registry_messages import EXPIRE_AFTER_S, HEARTBEAT_S, NodeRecord
from pdserve.cluster.registry_redis import INDEX_KEY, RedisNodeRegistration, record_key
from pdserve.testing.redis_server import redis_server, start_redis_server, stop_redis_server
from pdserve.testing.up_cluster import node_stats, wait_for
from pdserve.wire.transport import free_port


@pytest.fixture(scope="module")
def llm():
    return LLM("builtin:tiny", num_kv_blocks=512)


@pytest.fixture(scope="module")
def registry():
    with redis_server() as (url, _):
        yield f"{url}/3"  # the path picks the database: the records must land in db 3


def _listed(url: str) -> dict[str, dict]:
    """The router's /health node listing; empty while the router is still starting."""
    try:
        return node_stats(url)
    except (httpx.HTTPError, KeyError, ValueError):
        return {}


@contextlib.contextmanager
def _router(registry: str, log_path: str):
    """`pdserve router` with the registry as its only source of nodes."""
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve", "--log-level", "INFO", "router", "--model", "builtin:tiny",
           "--port", str(port), "--registry", registry, "--kv-transfer", "nixl",
           "--decode-policy", "round_robin", "--local-prefill-threshold", "0"]
    with open(log_path, "a") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        terminate_process(proc)


@pytest.fixture(scope="module")
def cluster(registry, tmp_path_factory):
    """A router and one decode node that meet only through the Redis registry."""
    logs = tmp_path_factory.mktemp("registry-redis")
    node, _ = start_decode(registry, "decode-0", str(logs / "decode-0.log"))
    try:
        with _router(registry, str(logs / "router.log")) as url:
            wait_for(lambda: _listed(url).get("decode-0", {}).get("healthy"), timeout_s=120)
            yield url
    finally:
        terminate_process(node)


def _stored(registry: str, node_id: str) -> tuple[NodeRecord | None, int]:
    """The node's record as Redis holds it, and its remaining TTL in ms (negative: none)."""
    client = redis.Redis.from_url(registry)
    try:
        value, ttl_ms = client.get(record_key(node_id)), client.pttl(record_key(node_id))
    finally:
        client.close()
    return (msgspec.msgpack.decode(value, type=NodeRecord) if value else None), ttl_ms


def _expired_keys(registry: str) -> int:
    """Keys Redis has expired so far (a deleted key does not count)."""
    client = redis.Redis.from_url(registry)
    try:
        return client.info("stats")["expired_keys"]
    finally:
        client.close()


def test_a_node_started_later_joins_serves_and_leaves_at_once_on_a_clean_exit(cluster, llm, registry, tmp_path):
    url = cluster
    serves(url, llm, "decode-0")
    late, addr = start_decode(registry, "decode-late", str(tmp_path / "late.log"))
    try:
        node = wait_for(lambda: _listed(url).get("decode-late", {}).get("healthy")
                        and _listed(url)["decode-late"], timeout_s=120)
        assert node["address"] == addr and node["role"] == "decode"
        record, ttl_ms = _stored(registry, "decode-late")
        assert record.control_addr == addr and 0 < ttl_ms <= EXPIRE_AFTER_S * 1000
        serves(url, llm, "decode-late")

        expired = _expired_keys(registry)
        late.send_signal(signal.SIGTERM)
        late.wait(timeout=30)
        # Deleted by the node on its way out, not expired: gone the moment the process is.
        assert _stored(registry, "decode-late") == (None, -2)
        stopped = time.monotonic()
        wait_for(lambda: "decode-late" not in _listed(url), timeout_s=EXPIRE_AFTER_S - 1, interval_s=0.05)
        print(f"clean exit: off the router's list {time.monotonic() - stopped:.2f} s after the process ended")
        assert _expired_keys(registry) == expired
        assert set(_listed(url)) == {"decode-0"}
    finally:
        stop_process(late)


def test_a_killed_node_leaves_after_its_records_ttl(cluster, registry, tmp_path):
    url = cluster
    doomed, _ = start_decode(registry, "decode-doomed", str(tmp_path / "doomed.log"))
    try:
        wait_for(lambda: _listed(url).get("decode-doomed", {}).get("healthy"), timeout_s=120)
        expired = _expired_keys(registry)
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(timeout=30)
        killed = time.monotonic()
        record, ttl_ms = _stored(registry, "decode-doomed")
        assert record is not None and ttl_ms > 0, "the record should outlive a killed node until its TTL"
        assert "decode-doomed" in _listed(url)
        wait_for(lambda: "decode-doomed" not in _listed(url), timeout_s=EXPIRE_AFTER_S + 3 * HEARTBEAT_S,
                 interval_s=0.05)
        gone_after = time.monotonic() - killed
        print(f"SIGKILL: off the router's list {gone_after:.2f} s after the kill (record TTL {ttl_ms} ms then)")
        assert gone_after >= ttl_ms / 1000 - 0.2, "dropped before the record expired"
        assert _expired_keys(registry) > expired, "the record was deleted, not expired"
        assert "decode-0" in _listed(url)
    finally:
        stop_process(doomed)


def _delete_record(registry: str, node_id: str) -> None:
    client = redis.Redis.from_url(registry)
    try:
        client.delete(record_key(node_id))
    finally:
        client.close()


def test_a_redis_outage_and_restart_keep_the_routers_nodes():
    port = free_port()
    url, server = start_redis_server(port=port)
    reg = RedisNodeRegistration(url, NodeRecord("prefill-x", "prefill", "tcp://127.0.0.1:1", incarnation=5)).start()

    async def scenario() -> list:
        nonlocal server
        task = asyncio.create_task(watch_pool(url, 12.0, lambda pool: [n.node_id for n in pool.nodes]))
        await asyncio.sleep(1.5)
        server.send_signal(signal.SIGSTOP)  # unreachable for longer than the TTL...
        await asyncio.sleep(EXPIRE_AFTER_S + 1.5)
        server.send_signal(signal.SIGCONT)
        # ...so the record has expired, and the router may read before the node writes again.
        # Keep the record away for the next 1.2 s (the router reads in that time), as when the
        # node's retry comes after the router's: the router must wait for it, not drop the node.
        # (Without this, the writes that waited in Redis's socket buffers restore the record.)
        for _ in range(60):
            _delete_record(url, "prefill-x")
            await asyncio.sleep(0.02)
        await asyncio.sleep(1.0)
        stop_redis_server(server)  # then Redis restarts empty on the same port
        await asyncio.sleep(0.5)
        _, server = start_redis_server(port=port)
        return await task

    try:
        samples = asyncio.run(scenario())
        assert _stored(url, "prefill-x")[0] is not None, "the node did not write its record to the new Redis"
        assert redis.Redis.from_url(url).zrange(INDEX_KEY, 0, -1) == [b"prefill-x"]
    finally:
        reg.close()
        stop_redis_server(server)
    assert samples[12:] and all(s == ["prefill-x"] for s in samples[12:]), samples
    assert reg.registrations >= 3, "the node did not write its record again after the outage and the restart"


def test_rediss_with_a_password_checks_the_certificate(tmp_path):
    tls, rogue_ca = make_certs(tmp_path)
    ca = tls.ca
    password = "reg p@ss"
    with redis_server(tls=tls, password=password) as (url, _):
        assert quote(password, safe="") in url  # the helper's url carries the password, encoded
        reg = RedisNodeRegistration(f"{url}/2?ca_file={quote(ca)}",
                                    NodeRecord("decode-tls", "decode", "tcp://127.0.0.1:1", incarnation=1)).start()
        try:
            trusted = asyncio.run(watch_pool(f"{url}/2?ca_file={quote(ca)}", 2.0,
                                             lambda pool: [n.node_id for n in pool.nodes]))
            untrusted = asyncio.run(watch_pool(f"{url}/2?ca_file={quote(rogue_ca)}", 2.0,
                                               lambda pool: [n.node_id for n in pool.nodes]))
        finally:
            reg.close()
    assert trusted[-1] == ["decode-tls"]
    assert all(s == [] for s in untrusted), "a certificate from an unknown CA was accepted"


def test_two_processes_under_one_node_id_are_reported(caplog):
    with redis_server() as (url, _):
        old = RedisNodeRegistration(url, NodeRecord("decode-twin", "decode", "tcp://127.0.0.1:1", incarnation=1))
        new = RedisNodeRegistration(url, NodeRecord("decode-twin", "decode", "tcp://127.0.0.1:2", incarnation=2))
        with caplog.at_level("WARNING", logger="pdserve.cluster.registry_redis"):
            old.start()
            new.start()
            try:
                wait_for(lambda: "a newer process (at tcp://127.0.0.1:2)" in caplog.text, timeout_s=5)
                new.close()
                # Once the newer process has gone, the older one's record is the one Redis keeps.
                wait_for(lambda: (_stored(url, "decode-twin")[0] or NodeRecord("", "", "")).incarnation == 1,
                         timeout_s=5)
            finally:
                old.close()
                new.close()
        assert "tcp://127.0.0.1:1" not in caplog.text, "the newer process warned about the older one"
