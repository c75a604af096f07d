"""The requests this router has on nodes, and where each node's replies for them go.

Each request has an owner: the node whose replies count (a reply from any other node, such as
one the request was moved off, is stale); its awaited reply and its stream have one each, since
in push mode a prefill node and a decode node serve it at once. A decode stream's tokens go to its queue; a request
that waits for one reply (a prefill, an embedding) waits on a future. Moving a request off a
node (the node died, drains, or rejected it) fails that future, or puts a Lost marker in the
stream's queue, so the path serving it retries elsewhere. A push-mode request moved off its
decode node before its handover was made also tells its prefill node that no blocks await its
WRITEs (a WriteTarget with none), so the handover it holds for them goes at once, to be READ."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from pdserve.protocol.outputs import StepOutput
from pdserve.router.dispatch.failover import NodeLost
from pdserve.router.dispatch.nodes import Node
from pdserve.wire.handover import NixlMetadata
from pdserve.wire.messages import (
    EmbedResult,
    EncodeResult,
    HandoverMade,
    Message,
    PrefillResult,
    PrefixLoaded,
    WriteTarget,
)


class Lost:
    """Queue marker: the decode node serving the request was lost (or drains: planned)."""

    def __init__(self, node_id: str, planned: bool = False):
        self.node_id = node_id
        self.planned = planned


class Inflight:
    def __init__(self, send_later: Callable[[str, Message], None] | None = None) -> None:
        self.send_later = send_later  # to a node by id, from these callbacks (NodePool.send_later)
        self.streams: dict[str, asyncio.Queue] = {}
        self.replies: dict[str, asyncio.Future] = {}  # request id -> its one reply (prefill, embedding)
        self.owner: dict[str, str | None] = {}  # request id -> the node whose stream tokens count
        self.reply_owner: dict[str, str | None] = {}  # request id -> the node whose awaited reply counts
        # A push-mode store handover that follows its first token (HandoverMade), and its node
        self.handovers: dict[str, asyncio.Future] = {}
        self.handover_owner: dict[str, str | None] = {}
        # Push mode over NIXL: where the decode node lets the prefill node WRITE the prompt's
        # blocks, for each prefill node the prompt goes to (a retry's too)
        self.write_targets: dict[str, WriteTarget] = {}
        self.prefilling: dict[str, str] = {}  # request id -> the node its last PrefillRequest went to

    def open_stream(self, rid: str) -> asyncio.Queue:
        self.streams[rid] = asyncio.Queue()
        return self.streams[rid]

    def close_stream(self, rid: str) -> None:
        self.streams.pop(rid, None)
        self.owner.pop(rid, None)
        self.reply_owner.pop(rid, None)
        self.write_targets.pop(rid, None)
        self.prefilling.pop(rid, None)
        self.drop_handover(rid)

    def assign(self, rid: str, node: Node) -> None:
        """The node serves the request now: its replies count, and it counts the request."""
        self.owner[rid] = node.node_id
        node.requests.add(rid)

    def expect_reply(self, rid: str, node: Node) -> asyncio.Future:
        """The future the node's one reply for `rid` resolves; the node owns the request now."""
        fut = asyncio.get_running_loop().create_future()
        self.replies[rid] = fut
        self.reply_owner[rid] = node.node_id
        return fut

    def awaits_reply(self, rid: str, node_id: str | None = None) -> bool:
        """A reply for `rid` is awaited (from node_id, when given)."""
        return rid in self.replies and (node_id is None or self.reply_owner.get(rid) == node_id)

    def drop_reply(self, rid: str, release: bool = False) -> None:
        """release: the request ends with this reply (an embedding), no node owns it now."""
        self.replies.pop(rid, None)
        if release:
            self.reply_owner.pop(rid, None)

    def on_reply(self, node: Node, msg: PrefillResult | EmbedResult | EncodeResult) -> None:
        fut = self.replies.get(msg.request_id)
        if fut is not None and not fut.done() and self.reply_owner.get(msg.request_id) == node.node_id:
            fut.set_result(msg)

    def expect_handover(self, rid: str, node: Node) -> asyncio.Future:
        """The future the node's HandoverMade for `rid` resolves; registered before the prompt is
        sent, so a HandoverMade that comes right after its first token is not missed."""
        fut = asyncio.get_running_loop().create_future()
        self.handovers[rid] = fut
        self.handover_owner[rid] = node.node_id
        return fut

    def awaits_handover(self, rid: str, node_id: str) -> bool:
        return rid in self.handovers and self.handover_owner.get(rid) == node_id

    def drop_handover(self, rid: str) -> None:
        self.handovers.pop(rid, None)
        self.handover_owner.pop(rid, None)

    def on_handover(self, node: Node, msg: HandoverMade) -> None:
        fut = self.handovers.get(msg.request_id)
        if fut is not None and not fut.done() and self.handover_owner.get(msg.request_id) == node.node_id:
            fut.set_result(msg.handover)

    def on_write_target(self, node: Node, msg: WriteTarget) -> str | None:
        """Kept for the prompt's prefill nodes; the one computing it now (its node id), if any.
        (Only once its PrefillRequest went: a target before it would be declined there.)"""
        if self.owner.get(msg.request_id) != node.node_id:
            return None  # (stale: the request left that decode node)
        self.write_targets[msg.request_id] = msg
        return self.prefilling.get(msg.request_id)

    def on_prefix_loaded(self, node: Node, msg: PrefixLoaded) -> str | None:
        """The decode node the request waits on (its node id), if `node` is the prefill node
        computing it now; None for a stale message (the prefill moved, or the stream ended)."""
        rid = msg.request_id
        if self.prefilling.get(rid) != node.node_id or rid not in self.streams:
            return None
        return self.owner.get(rid)

    def on_output(self, node: Node, out: StepOutput) -> None:
        queue = self.streams.get(out.request_id)
        if queue is not None and self.owner.get(out.request_id) == node.node_id:
            queue.put_nowait(out)

    def move(self, node: Node, request_ids: list[str], planned: bool = False) -> int:
        """Take these requests off `node` as if it were lost: a prefill is retried elsewhere, a
        decode stream resumes on another decode node (the failover path). planned: the node
        drains, so the move does not count against a stream's failure budget. Returns how many moved."""
        moved = 0
        for rid in request_ids:
            replying, streaming = (self.reply_owner.get(rid) == node.node_id, self.owner.get(rid) == node.node_id)
            handing = self.handover_owner.get(rid) == node.node_id
            if not (replying or streaming or handing):
                continue
            node.requests.discard(rid)
            moved += 1
            if handing:
                self.handover_owner[rid] = None
                self._fail(self.handovers.get(rid), NodeLost(node.node_id, planned))
            if replying:
                self.reply_owner[rid] = None  # whatever the node still sends for it is stale
                self._fail(self.replies.get(rid), NodeLost(node.node_id, planned))
            if streaming:
                self.owner[rid] = None
                self._void_write_target(rid)
                queue = self.streams.get(rid)
                if queue is not None:
                    queue.put_nowait(Lost(node.node_id, planned))
        return moved

    def _void_write_target(self, rid: str) -> None:
        """No decode node waits for this request's WRITEs now: a prefill node it goes to (a retry)
        is sent an empty target, and the one computing it now too while its handover is still to
        be made (in push mode that handover waits for a target; the stream moves in pull mode)."""
        void = WriteTarget(rid, NixlMetadata("", b""), 0, [], 0.0)
        self.write_targets[rid] = void
        prefill = self.prefilling.get(rid)
        if prefill is not None and rid in self.handovers and self.send_later is not None:
            self.send_later(prefill, void)

    @staticmethod
    def _fail(fut: asyncio.Future | None, exc: Exception) -> None:
        if fut is not None and not fut.done():
            fut.set_exception(exc)
