"""A NodeOwner's admin socket: the routers' StartNode / StopNode / SetNodeRole / ListNodes requests
(`pdserve scale`, the router's /admin routes) answered from a thread of the owner's process.

`pdserve up --ray` serves it from the controller actor; routers reach it through --owner.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq

from pdserve.cluster.owner import NodeOwner
from pdserve.wire.messages import ListNodes, OwnerReply, SetNodeRole, StartNode, StopNode
from pdserve.wire.transport import NodeSocket

log = logging.getLogger(__name__)
POLL_MS = 200


class OwnerAdminServer:
    """Answers one request at a time; `address_of(node_id)` gives a started node's control
    endpoint (the router connects to it at once, before the node registers)."""

    def __init__(self, owner: NodeOwner, bind: str, address_of: Callable[[str], str]):
        self.owner = owner
        self.address_of = address_of
        self.socket = NodeSocket(zmq.Context.instance(), bind)
        self.address = self.socket.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="owner-admin", daemon=True)

    def start(self) -> OwnerAdminServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.socket.sock.poll(POLL_MS):
                    continue
                while (item := self.socket.recv()) is not None:
                    identity, msg = item
                    self.socket.send(identity, self.answer(msg))
        finally:
            self.socket.close()

    def answer(self, msg) -> OwnerReply:
        return answer_owner_request(self.owner, msg, self.address_of)


def answer_owner_request(owner: NodeOwner, msg, address_of: Callable[[str], str]) -> OwnerReply:
    """Carry out one router request on the owner; the reply always lists the owned nodes."""
    try:
        if isinstance(msg, StartNode):
            node_id = owner.start_node(msg.role)
            reply = OwnerReply(True, node_id=node_id, address=address_of(node_id))
        elif isinstance(msg, StopNode):
            owner.stop_node(msg.node_id)
            reply = OwnerReply(True, node_id=msg.node_id)
        elif isinstance(msg, SetNodeRole):
            owner.set_role(msg.node_id, msg.role)
            reply = OwnerReply(True, node_id=msg.node_id)
        elif isinstance(msg, ListNodes):
            reply = OwnerReply(True)
        else:
            reply = OwnerReply(False, f"unexpected {type(msg).__name__}")
    except Exception as exc:  # a failed start or stop is the caller's answer, not the owner's end
        log.exception("owner admin request failed")
        reply = OwnerReply(False, f"{type(exc).__name__}: {exc}")
    return OwnerReply(reply.ok, reply.detail, reply.node_id, reply.address, owner.owned_nodes())
