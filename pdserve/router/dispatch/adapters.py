"""The LoRA adapters a router serves, and how they reach its nodes.

- The set: name -> PEFT directory. --lora-modules at start; POST /v1/load_lora_adapter and
  /v1/unload_lora_adapter change it at run time (routes/lora_routes.py). A request names an adapter as
  its `model`.
- Loading and unloading fan out to every node as LoadLoRA / UnloadLoRA and wait for the replies;
  a load that some node refuses (a bad directory, a rank above its --max-lora-rank) is undone on
  the others and answered 400. An unload first takes the name away from new requests, then waits
  for the requests this router has in flight on the adapter to end before the nodes drop it: a
  request between its prefill and its decode must find the adapter on its decode node.
- Nodes that join later, or restart: each pong lists the adapters the node has. One that lacks
  some of this router's gets a LoadLoRA for each, and, before any request naming an adapter is
  sent to a node that has not reported it, the LoadLoRA goes first on the same socket (the node
  reads its messages in order), so the node loads it before serving.
- Routing: a node's cost for an adapter is 0 when resident in its slots (active_loras), 1 when
  registered only (a slot load), 2 when absent (read from disk first); the planner prefers the
  cheapest nodes (placement/policy.py).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from pdserve.router.dispatch.nodes import Node, NodePool
from pdserve.wire.messages import LoadLoRA, LoRAReply, Pong, UnloadLoRA

log = logging.getLogger(__name__)
FAN_OUT_TIMEOUT_S = 60.0
RESEND_AFTER_S = 5.0  # a LoadLoRA the node's pongs still do not reflect is sent again after this
UNLOAD_DRAIN_S = 300.0  # an unload waits at most this long for the adapter's requests in flight


class AdapterError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class NodeAdapters:
    """What one node reported in its last pong, and the loads sent to it since."""
    registered: set[str] = field(default_factory=set)
    active: set[str] = field(default_factory=set)
    enabled: bool = False  # the node serves adapters at all
    sent: dict[str, float] = field(default_factory=dict)  # name -> when its LoadLoRA was sent


class RouterAdapters:
    def __init__(self, modules: dict[str, str] | None = None, pool: NodePool | None = None):
        self.paths: dict[str, str] = dict(modules or {})
        self.nodes: dict[str, NodeAdapters] = {}
        self._seq = itertools.count(1)
        self._replies: dict[int, asyncio.Future] = {}
        self.pool = pool  # the cluster's nodes (None: an app without a cluster, nothing to load)
        self.in_flight: Counter[str] = Counter()  # requests on each adapter, routed by this router

    def __contains__(self, name: object) -> bool:
        return name in self.paths

    def names(self) -> list[str]:
        return list(self.paths)

    def cost(self, node_id: str, name: str | None) -> int:
        """0: resident in the node's slots (or no adapter); 1: registered; 2: absent."""
        if name is None:
            return 0
        state = self.nodes.get(node_id)
        if state is None or name not in state.registered:
            return 2
        return 0 if name in state.active else 1

    def begin(self, name: str | None) -> bool:
        """A request on `name` starts (False: the adapter was unloaded meanwhile)."""
        if name is not None:
            if name not in self.paths:
                return False
            self.in_flight[name] += 1
        return True

    def end(self, name: str | None) -> None:
        if name is not None:
            self.in_flight[name] -= 1
            if self.in_flight[name] <= 0:
                del self.in_flight[name]

    # ---- run-time load and unload ------------------------------------------------------------
    async def load(self, name: str, path: str, reserved: list[str]) -> None:
        if name in self.paths or name in reserved:
            raise AdapterError(400, f"The lora adapter '{name}' has already been loaded.")
        replies = await self._fan_out(lambda seq: LoadLoRA(name, path, seq))
        refused = {node: r.detail for node, r in replies.items() if r is not None and not r.ok}
        if refused:
            await self._fan_out(lambda seq: UnloadLoRA(name, seq),
                                [n for n, r in replies.items() if r is not None and r.ok])
            node, detail = next(iter(refused.items()))
            raise AdapterError(400, f"loading LoRA adapter '{name}' failed on {node}: {detail}")
        self.paths[name] = path
        log.info("LoRA adapter %r loaded from %s on %d nodes", name, path, len(replies))

    async def unload(self, name: str) -> None:
        if self.paths.pop(name, None) is None:  # new requests naming it get 404 from now on
            raise AdapterError(404, f"The lora adapter '{name}' cannot be found.")
        deadline = time.monotonic() + UNLOAD_DRAIN_S
        while self.in_flight[name] > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.in_flight.pop(name, None)
        await self._fan_out(lambda seq: UnloadLoRA(name, seq))
        log.info("LoRA adapter %r unloaded", name)

    async def _fan_out(self, make, node_ids: list[str] | None = None) -> dict[str, LoRAReply | None]:
        """Send make(seq) to every healthy node (or those named) and wait for their replies;
        None for a node that did not answer in time (it catches up from its pongs)."""
        nodes = [n for n in self.pool.nodes if n.healthy and (node_ids is None or n.node_id in node_ids)]
        waits = {}
        for node in nodes:
            seq = next(self._seq)
            waits[node.node_id] = self._replies[seq] = asyncio.get_running_loop().create_future()
            await self.pool.send(node, make(seq))
        done, _ = await asyncio.wait(waits.values(), timeout=FAN_OUT_TIMEOUT_S) if waits else (set(), set())
        for seq in [s for s, fut in self._replies.items() if fut in waits.values()]:
            self._replies.pop(seq, None)
        return {node_id: fut.result() if fut in done else None for node_id, fut in waits.items()}

    # ---- node messages -----------------------------------------------------------------------
    def on_reply(self, msg: LoRAReply) -> None:
        fut = self._replies.pop(msg.seq, None)
        if fut is not None and not fut.done():
            fut.set_result(msg)
        elif not msg.ok:
            log.warning("a node could not load a LoRA adapter: %s", msg.detail)

    def on_pong(self, node, msg: Pong) -> list[LoadLoRA]:
        """Record the node's adapters; the LoadLoRA messages it needs to catch up."""
        state = self.nodes.setdefault(node.node_id, NodeAdapters())
        state.registered, state.active, state.enabled = set(msg.loras), set(msg.active_loras), msg.lora_enabled
        return [self._load_msg(state, name) for name in self.paths if self._needs(state, name)]

    async def send_ahead(self, node: Node, name: str | None) -> None:
        """A node that may lack the request's adapter is told to load it first (it reads its
        messages in order, so it has it when the request arrives)."""
        load = self.before_request(node, name)
        if load is not None:
            await self.pool.send(node, load)

    def enabled_anywhere(self) -> bool:
        """Some healthy node serves adapters (a node that has not answered a ping yet counts:
        its pong may still say so)."""
        healthy = {n.node_id for n in self.pool.nodes if n.healthy} if self.pool is not None else set()
        return any(self.nodes.get(n, NodeAdapters(enabled=True)).enabled for n in healthy)

    def report(self, node_id: str) -> dict:
        """The node's adapters from its last pong: registered and resident in its slots."""
        state = self.nodes.get(node_id)
        return {"loras": sorted(state.registered), "active_loras": sorted(state.active)} if state else {}

    def before_request(self, node, name: str | None) -> LoadLoRA | None:
        """A LoadLoRA to send ahead of a request naming `name`, if the node may lack it."""
        if name is None or name not in self.paths:
            return None
        state = self.nodes.setdefault(node.node_id, NodeAdapters())
        return self._load_msg(state, name) if self._needs(state, name) else None

    def _needs(self, state: NodeAdapters, name: str) -> bool:
        sent = state.sent.get(name)
        return name not in state.registered and (sent is None or time.monotonic() - sent > RESEND_AFTER_S)

    def _load_msg(self, state: NodeAdapters, name: str) -> LoadLoRA:
        state.sent[name] = time.monotonic()
        return LoadLoRA(name, self.paths[name], 0)  # seq 0: nobody waits for the reply
