"""Keeps a router's NodePool equal to the registry's membership.

The watcher asks the registry for the membership every HEARTBEAT_S (its subscription and
keep-alive) and receives every change as it happens. Each Membership is applied as a diff:
  * a node not in the pool is added (it joins the rotation at its first Pong);
  * a node whose address or role changed (restarted elsewhere, switched) is replaced;
  * a node's `draining` flag follows its record's state;
  * a node the watcher added that left the membership is removed (its requests move on), but
    not while it still answers pings: a record also expires when a loaded host starves the
    node's heartbeat thread for EXPIRE_AFTER_S, and such a node registers again on its next
    heartbeat. Removing it would move its requests for nothing, and when it was the last node
    of its role fail them (a dead node comes back from nowhere). It goes once it falls silent
    or disconnects, or comes back into the membership.
A node given on the command line (--prefill/--decode) is left alone until a node registers under
its id (`pdserve up` gives both, so its router routes at once, before any membership arrives):
from then on the registry speaks for it. A static node that never registers is never removed.

The memberships come from the zmq registry (below) or, for a redis:// URL, from reading the
records in Redis every HEARTBEAT_S (cluster/registry_redis.py); both feed apply().

An unreachable registry changes nothing: the pool keeps its last membership. A restarted
registry (a new epoch) starts empty and fills as nodes re-register on their next heartbeat, so
for EXPIRE_AFTER_S after a new epoch the watcher adds and updates but removes nothing.
"""
from __future__ import annotations

import logging
import time

import msgspec
import zmq
import zmq.asyncio

from pdserve.cluster.registry_messages import (
    DRAINING,
    EXPIRE_AFTER_S,
    HEARTBEAT_S,
    Membership,
    NodeRecord,
    SnapshotRequest,
    decode,
    encode,
    is_redis_url,
)
from pdserve.router.dispatch.nodes import NodePool

log = logging.getLogger(__name__)


class RegistryWatcher:
    def __init__(self, registry_url: str, pool: NodePool):
        self.registry_url = registry_url
        self.pool = pool
        self.managed: set[str] = set()  # node ids this watcher added
        self.epoch = 0
        self.version = -1
        self.epoch_seen_at = -EXPIRE_AFTER_S  # when a restarted registry was first seen
        self.removals_deferred = False
        self.unlisted: set[str] = set()  # left the membership while still answering pings: kept
        self.applied = 0  # memberships applied (tests and /health read it)

    async def run(self) -> None:
        if is_redis_url(self.registry_url):
            from pdserve.cluster.registry_redis import watch_redis  # optional: redis, only for a redis:// registry
            await watch_redis(self.registry_url, self.apply)
            return
        await self._watch_zmq()

    async def _watch_zmq(self) -> None:
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)
        sock.connect(self.registry_url)
        try:
            next_ask = 0.0
            while True:
                now = time.monotonic()
                if now >= next_ask:
                    try:
                        await sock.send(encode(SnapshotRequest()), zmq.NOBLOCK)
                    except zmq.Again:  # the registry is down: keep the last membership
                        pass
                    next_ask = now + HEARTBEAT_S
                if await sock.poll(int(max(next_ask - time.monotonic(), 0.01) * 1000)):
                    await self._receive(sock)
        finally:
            sock.close(0)

    async def _receive(self, sock: zmq.asyncio.Socket) -> None:
        try:
            msg = decode(await sock.recv())
        except msgspec.DecodeError as exc:
            log.warning("undecodable message from the registry: %s", exc)
            return
        if isinstance(msg, Membership):
            await self.apply(msg)

    async def apply(self, membership: Membership) -> None:
        if membership.epoch != self.epoch:
            if self.epoch:  # not the first membership this router sees
                log.info("the registry restarted: keeping every node until it has heard from them")
                self.epoch_seen_at = time.monotonic()
            self.epoch, self.version = membership.epoch, -1
        # An unchanged membership is applied again while removals wait for the grace after a
        # restart to end: else a node that never re-registered would stay in the pool for good.
        if membership.version < self.version or (membership.version == self.version
                                                 and not self.removals_deferred and not self.unlisted):
            return
        self.version = membership.version
        self.applied += 1
        records = {r.node_id: r for r in membership.records}
        for record in records.values():
            await self._apply_record(record)
        self.removals_deferred = time.monotonic() - self.epoch_seen_at < EXPIRE_AFTER_S
        if self.removals_deferred:
            return  # a fresh registry may not have heard from every node yet
        self.unlisted &= self.managed - records.keys()
        for node_id in sorted(self.managed - records.keys()):
            await self._remove_unlisted(node_id)

    async def _remove_unlisted(self, node_id: str) -> None:
        node = self.pool.get(node_id)
        # A record can expire before the node's first pong on a loaded host: without this wait a
        # node whose heartbeat lags its record's expiry would be added and removed forever.
        if node is not None and node.awaiting_first_pong():
            self.unlisted.add(node_id)
            return
        if node is not None and node.healthy:  # its record expired, not the node (see above)
            if node_id not in self.unlisted:
                log.warning("%s left the membership but still answers: kept until it falls silent, "
                            "disconnects or registers again", node_id)
                self.unlisted.add(node_id)
            return
        self.unlisted.discard(node_id)
        self.managed.discard(node_id)
        await self.pool.remove_node(node_id)

    async def _apply_record(self, record: NodeRecord) -> None:
        node = self.pool.get(record.node_id)
        if node is not None and record.node_id not in self.managed:
            log.info("%s, given on the command line, registered: the registry speaks for it now", record.node_id)
            self.managed.add(record.node_id)
        if node is not None and (node.address != record.control_addr or node.role != record.role):
            log.info("%s moved: %s %s -> %s %s", record.node_id, node.role, node.address, record.role,
                     record.control_addr)
            await self.pool.remove_node(record.node_id)
            node = None
        if node is None:
            node = self.pool.add_node(record.node_id, record.role, record.control_addr, record.nixl_side_channel)
            self.managed.add(record.node_id)
            if record.compat is not None:  # only when added: its pongs keep it current from then on
                self.pool.check_registered(node, record.compat)
        draining = record.state == DRAINING
        if node.draining != draining:
            log.info("%s is %s", record.node_id, "draining" if draining else "active again")
            node.draining = draining
