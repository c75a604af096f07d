"""What the router does with each message a node sends (NodePool hands them here), and when a
node dies: replies and tokens go to the requests waiting on them (inflight), pongs to the
drains, the LoRA adapters and the KV event tracker, KV events to the prefix index."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from pdserve.router.dispatch.adapters import RouterAdapters
from pdserve.router.dispatch.drain import DrainTracker
from pdserve.router.dispatch.inflight import Inflight
from pdserve.router.dispatch.nodes import Node, NodePool
from pdserve.router.placement.index import PrefixIndex
from pdserve.router.placement.kv_events import KVEventTracker
from pdserve.wire.messages import (
    EmbedResult,
    EncodeResult,
    HandoverMade,
    KVEvents,
    KVSnapshotRequest,
    LoRAReply,
    Message,
    Pong,
    PrefillResult,
    PrefixLoaded,
    Rejected,
    TokenDelta,
    TokenDeltas,
    WriteTarget,
    token_outputs,
)

log = logging.getLogger("pdserve.router.dispatch.cluster")


@dataclass
class NodeEvents:
    pool: NodePool
    inflight: Inflight
    drains: DrainTracker
    adapters: RouterAdapters
    index: PrefixIndex
    kv_tracker: KVEventTracker
    def on_dead(self, node: Node) -> None:
        self.index.drop_node(node.node_id)  # it comes back, if at all, with an empty cache
        self.kv_tracker.forget(node.node_id)
        self.inflight.move(node, list(node.requests))

    def on_message(self, node: Node, msg: Message) -> None:
        if isinstance(msg, Pong):
            self._on_pong(node, msg)
        elif isinstance(msg, Rejected):  # the node changed role before the request reached it
            log.info("[%s] %s rejected it (%s): moving it", msg.request_id, node.node_id, msg.reason)
            self.inflight.move(node, [msg.request_id])
            node.requests.discard(msg.request_id)
        elif isinstance(msg, LoRAReply):
            self.adapters.on_reply(msg)
        elif isinstance(msg, KVEvents):
            if self.kv_tracker.apply(node.node_id, msg):
                log.info("%s: KV event gap (epoch %d, seq %d): asking for a snapshot", node.node_id,
                         msg.epoch, msg.seq)
                self.pool.send_later(node.node_id, KVSnapshotRequest())
        elif isinstance(msg, (PrefillResult, EmbedResult, EncodeResult)):  # one reply per request, awaited
            if not self.inflight.awaits_handover(msg.request_id, node.node_id):  # (a handover to follow: still on it)
                node.requests.discard(msg.request_id)
            self.inflight.on_reply(node, msg)
        elif isinstance(msg, WriteTarget):  # push mode: the decode node's blocks, for the prefill node
            prefill = self.inflight.on_write_target(node, msg)
            if prefill is not None:
                self.pool.send_later(prefill, msg)
        elif isinstance(msg, PrefixLoaded):  # push mode: the decode node may load the stored prefix now
            decode = self.inflight.on_prefix_loaded(node, msg)
            if decode is not None:
                self.pool.send_later(decode, msg)
        elif isinstance(msg, HandoverMade):
            node.requests.discard(msg.request_id)
            self.inflight.on_handover(node, msg)
        elif isinstance(msg, (TokenDelta, TokenDeltas)):  # a step's outputs for this router
            for out in token_outputs(msg):
                if out.finished:
                    node.requests.discard(out.request_id)
                self.inflight.on_output(node, out)

    def _on_pong(self, node: Node, msg: Pong) -> None:
        self.drains.on_pong(node, msg)
        for load in self.adapters.on_pong(node, msg):  # a node that joined later catches up
            self.pool.send_later(node.node_id, load)
        if self.kv_tracker.needs_snapshot(node.node_id):
            self.pool.send_later(node.node_id, KVSnapshotRequest())
