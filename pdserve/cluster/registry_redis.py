"""The node registry kept in Redis: `--registry redis://HOST:PORT[/DB]` (or rediss://, with
`?ca_file=PATH` as for the store), for nodes
and routers started by hand where a Redis runs anyway (compose, bare hosts) and no registry
process should.

Key layout (in the URL's database):
  pdserve:node:<node_id>   the node's NodeRecord (msgspec msgpack), with a TTL of EXPIRE_AFTER_S;
  pdserve:nodes            a sorted set of node ids scored by the time of their last write (ms),
                           so routers find the records without SCANning a KV store's keyspace.

A node (RedisNodeRegistration) writes its record and its index entry every HEARTBEAT_S, and at
once when the record changes. The write is the registration and the heartbeat in one, so a
record that expired, or a Redis that restarted empty, is whole again within a second. A node
that dies stops writing and its record expires by itself; a clean exit deletes the record (only
while it is still this process's: a node restarted under the same id keeps its own).

A router (watch_redis) reads the index and the records every HEARTBEAT_S and hands
RegistryWatcher.apply the Membership the zmq registry would have sent. After a Redis restart
(a new run_id) or a Redis outage the membership has a new epoch, so the watcher removes nothing
for EXPIRE_AFTER_S while the nodes write again. While Redis is unreachable, nodes log it, serve
on and retry; routers keep their last membership.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import msgspec
import redis
import redis.asyncio
import redis.asyncio.retry
import redis.retry
from redis.backoff import NoBackoff

from pdserve.cluster.registration import NodeRegistration
from pdserve.cluster.registry_messages import EXPIRE_AFTER_S, HEARTBEAT_S, Membership, NodeRecord
from pdserve.kvstore.redact import redact_url
from pdserve.kvstore.redis_tls import tls_options

log = logging.getLogger(__name__)

INDEX_KEY = "pdserve:nodes"
RECORD_PREFIX = "pdserve:node:"
# Index entries are pruned this long after their node's last write: far past the record's TTL,
# so clocks that disagree by less than this never prune a live node's entry.
PRUNE_AFTER_S = 60.0
# Timeouts of a heartbeat and no retries inside a call: a lost Redis costs one beat, not the
# client's default backoff of several seconds (which would also hold up a node's clean exit).
CLIENT_OPTIONS = {"socket_timeout": HEARTBEAT_S, "socket_connect_timeout": HEARTBEAT_S}

# Delete the record only if it still holds what this process wrote last.
_DELETE_IF_OURS = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    redis.call('ZREM', KEYS[2], ARGV[2])
    return redis.call('DEL', KEYS[1])
end
return 0
"""

_decode_record = msgspec.msgpack.Decoder(NodeRecord).decode


def record_key(node_id: str) -> str:
    return RECORD_PREFIX + node_id


def connection(registry_url: str) -> tuple[str, dict]:
    """redis-py's URL and client options for a registry URL. rediss:// verifies the server's
    certificate and host name, against `?ca_file=PATH` if given (as the store's URLs do), else
    the system CAs. Raises ValueError for a CA file that is missing or given without TLS."""
    parts = urlsplit(registry_url)
    query = parse_qs(parts.query)
    ca_file = query.pop("ca_file", [None])[0]
    options = {**CLIENT_OPTIONS, **tls_options(registry_url, ca_file, tls_schemes="rediss://")}
    return urlunsplit(parts._replace(query=urlencode(query, doseq=True))), options


class _OutageLog:
    """Logs the first failure of an outage and the recovery, not every retry in between."""

    def __init__(self, who: str, url: str, while_down: str):
        self.who, self.url, self.while_down = who, redact_url(url), while_down
        self.down = False

    def failed(self, exc: Exception) -> None:
        if not self.down:
            log.warning("%s: the Redis registry at %s is unreachable (%s: %s): %s", self.who, self.url,
                        type(exc).__name__, exc, self.while_down)
        self.down = True

    def ok(self) -> None:
        if self.down:
            log.info("%s: the Redis registry at %s answers again", self.who, self.url)
        self.down = False


class RedisNodeRegistration(NodeRegistration):
    """NodeRegistration with the record kept in Redis: same record, update() and close()."""

    def _run(self) -> None:
        url, options = connection(self.registry_url)
        client = redis.Redis.from_url(url, retry=redis.retry.Retry(NoBackoff(), 0), **options)
        outage = _OutageLog(self.record.node_id, self.registry_url, "serving on, retrying every heartbeat")
        written = b""  # what this process last wrote, so the exit deletes only its own record
        try:
            while not self._stop.is_set():
                try:
                    written = self._write(client)
                    outage.ok()
                except redis.RedisError as exc:
                    outage.failed(exc)
                if self._changed.wait(timeout=HEARTBEAT_S):
                    self._changed.clear()
            self._delete(client, written)
        finally:
            client.close()

    def _write(self, client: redis.Redis) -> bytes:
        record = self.record
        value = msgspec.msgpack.encode(record)
        pipe = client.pipeline(transaction=True)
        pipe.set(record_key(record.node_id), value, px=int(EXPIRE_AFTER_S * 1000), get=True)
        pipe.zadd(INDEX_KEY, {record.node_id: time.time() * 1000})
        previous, _ = pipe.execute()
        if previous is None:  # first write, or Redis lost the record (restarted, or it expired)
            self.registrations += 1
            log.info("%s %s registered in Redis%s", record.role, record.node_id,
                     " again (its record was gone)" if self.registrations > 1 else "")
        elif previous != value:
            self._check_overwritten(record, previous)
        return value

    def _check_overwritten(self, record: NodeRecord, previous: bytes) -> None:
        """Unlike the zmq registry, Redis keeps whichever process wrote last: say so when two
        live processes share a node id (a newer incarnation wrote in between)."""
        try:
            other = _decode_record(previous)
        except msgspec.DecodeError:
            return
        if other.incarnation > record.incarnation:
            log.warning("%s: a newer process (at %s) registers under the same node id; the two "
                        "overwrite each other's record: give each node its own --node-id",
                        record.node_id, other.control_addr)

    def _delete(self, client: redis.Redis, written: bytes) -> None:
        if not written:
            return
        node_id = self.record.node_id
        try:
            client.eval(_DELETE_IF_OURS, 2, record_key(node_id), INDEX_KEY, written, node_id)
        except redis.RedisError as exc:  # the record expires by itself
            log.warning("%s: could not deregister from Redis (%s); the record expires in %.0f s", node_id, exc,
                        EXPIRE_AFTER_S)


class RedisMembershipReader:
    """One read of the registry per call: the index, the records and the server's run_id.

    The epoch grows when the run_id changes (Redis restarted empty) and on the first read after
    a failed one (records may have expired while nodes could not reach Redis either): either
    way RegistryWatcher.apply then removes nothing until the nodes have had EXPIRE_AFTER_S to
    write again, where an early read would drop live nodes and reconnect them a second later."""

    def __init__(self):
        self.version = 0
        self.epoch = 0
        self.run_id = ""
        self.interrupted = False  # set by the caller when a read failed

    async def read(self, client: redis.asyncio.Redis) -> Membership:
        async with client.pipeline(transaction=False) as pipe:
            pipe.zremrangebyscore(INDEX_KEY, "-inf", (time.time() - PRUNE_AFTER_S) * 1000)
            pipe.zrange(INDEX_KEY, 0, -1)
            pipe.info("server")
            _, ids, info = await pipe.execute()
        values = await client.mget([record_key(i.decode()) for i in ids]) if ids else []
        records = []
        for value in values:
            if value is None:  # expired since the index was read
                continue
            try:
                records.append(_decode_record(value))
            except msgspec.DecodeError as exc:
                log.warning("undecodable node record in the Redis registry: %s", exc)
        # Every read is a new version: apply() is a diff, so an unchanged membership changes
        # nothing, and removals held after a Redis restart take effect once the hold ends.
        self.version += 1
        if info["run_id"] != self.run_id or self.interrupted:
            self.epoch += 1
            self.run_id, self.interrupted = info["run_id"], False
        return Membership(self.version, records, self.epoch)


async def watch_redis(registry_url: str, apply: Callable[[Membership], Awaitable[None]]) -> None:
    """RegistryWatcher.run for a Redis registry: apply the membership every HEARTBEAT_S."""
    url, options = connection(registry_url)
    client = redis.asyncio.Redis.from_url(url, retry=redis.asyncio.retry.Retry(NoBackoff(), 0), **options)
    reader = RedisMembershipReader()
    outage = _OutageLog("router", registry_url, "keeping the last membership")
    try:
        while True:
            try:
                membership = await reader.read(client)
                outage.ok()
            except (redis.RedisError, OSError) as exc:
                outage.failed(exc)
                reader.interrupted = True
            else:
                await apply(membership)
            if asyncio.current_task().cancelling():
                # A cancel that redis-py swallowed (or turned into its own TimeoutError, caught
                # above) as a read timed out: without this check the loop would never stop.
                raise asyncio.CancelledError
            await asyncio.sleep(HEARTBEAT_S)
    finally:
        await client.aclose()
