"""A decode node's push-mode requests (`--handover push`): the router sends the DecodeRequest
beside the PrefillRequest, so the request is admitted and its blocks allocated while the prefill
node computes the prompt; the KVReady that follows brings the first token and the handover, and
the pull starts at once (pdserve.node.decode).

A request waits here between the two messages. One that found no room for its blocks waits with
none allocated and is admitted as a pull-mode request when its KVReady comes (it must not compute
the prompt itself: the prefill node's first token is the one the client gets). A KVReady with no
first token means no prefill node could compute the prompt: the decode node computes it, as it
does a pull-mode request with no handover.

Over NIXL the node also names the blocks it allocated (a WriteTarget, through the router to the
prefill node), which the prefill node WRITEs as its chunks complete (pdserve.node.push_writes). A
request aborted while those writes may still come keeps its blocks (fenced) until the prefill node
says it is done writing, or the target's lease has passed: freed earlier, they could be another
request's by the time a late WRITE lands."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Protocol

from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import Request, RequestStatus
from pdserve.node.store_prefetch import StorePrefetch
from pdserve.wire.handover import KVHandover
from pdserve.wire.messages import DecodeRequest, KVReady, Message, WriteTarget
from pdserve.wire.transport import NodeSocket

log = logging.getLogger(__name__)
# A KVReady later than this (the router's prefill timeout and more) will not come: its router
# is gone without a word (a router that stops pinging takes its requests sooner).
WAIT_LIMIT_S = 600.0
WRITE_LEASE_S = 30.0  # a prefill node writes into a target's blocks for this long after it gets it
FENCE_MARGIN_S = 5.0  # ... and the target takes at most this long to reach it (router, queues)


class PushHost(Protocol):
    """What of the decode node (pdserve.node.decode) this uses."""
    engine: LLMEngine
    origin: dict[str, bytes]
    placements: dict[str, int]
    control: NodeSocket
    prefetch: StorePrefetch

    def handle(self, identity: bytes, msg: Message) -> None: ...
    def admit_pushed(self, identity: bytes, msg: DecodeRequest, ready: KVReady) -> None: ...
    def release_sender(self, handover: KVHandover, rid: str) -> None: ...
    def write_target(self, rid: str, req: Request | None, lease_s: float, lend_from_tokens: int = -1
                     ) -> WriteTarget | None: ...
    def fail(self, identity: bytes, request_id: str, error: str) -> None: ...
    def abort(self, request_id: str) -> None: ...


@dataclass
class PushWait:
    identity: bytes
    msg: DecodeRequest
    allocated: bool  # its blocks wait in WAITING_FOR_REMOTE_KVS (else it is admitted at KVReady)
    since: float


class PushIntake:
    def __init__(self, node: PushHost):
        self.node = node
        self.waits: dict[str, PushWait] = {}
        self.granted: dict[str, float] = {}  # request id -> when no WRITE can come into its blocks
        self.fenced: set[str] = set()  # aborted, its blocks kept until then (or the writer's word)

    def admit(self, identity: bytes, msg: DecodeRequest) -> None:
        node, rid = self.node, msg.request_id
        try:
            req = node.engine.add_request(rid, msg.prompt_token_ids, msg.params,
                                          remote_kv_tokens=len(msg.prompt_token_ids), first_token_pending=True,
                                          cache_salt=msg.cache_salt, lora_name=msg.adapter, images=msg.images)
        except ValueError as exc:
            return node.fail(identity, rid, str(exc))
        allocated = req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        if not allocated:  # no room: it would compute the prompt and draw a first token of its own
            node.engine.abort_request(rid)
        self.waits[rid] = PushWait(identity, msg, allocated, time.monotonic())
        node.origin[rid] = identity
        node.placements["prefills_pushed"] += 1
        target = node.write_target(rid, req if allocated else None, WRITE_LEASE_S, msg.lend_from_tokens)
        if target is not None:  # (one with no regions tells the prefill node not to wait for it)
            if target.regions or target.held:
                self.granted[rid] = time.monotonic() + WRITE_LEASE_S + FENCE_MARGIN_S
            node.control.send(identity, target)
        if allocated:
            node.prefetch.await_prefill_load(req, msg)

    def ready(self, msg: KVReady) -> None:
        node, rid = self.node, msg.request_id
        wait = self.waits.pop(rid, None)
        if wait is None:  # aborted meanwhile: let the prefill node free what it pinned
            if msg.handover is not None:
                node.release_sender(msg.handover, rid)
            return
        if not wait.allocated:
            return node.handle(wait.identity, dataclasses.replace(wait.msg, push=False, handover=msg.handover,
                                                                  first_token_ids=msg.first_token_ids))
        node.admit_pushed(wait.identity, wait.msg, msg)

    def forget(self, rid: str) -> bool:
        """The request is aborted; True: its blocks must wait (fenced) for the writes to end."""
        waited = self.waits.pop(rid, None) is not None
        if waited and rid in self.granted:
            self.fenced.add(rid)
            return True
        self.granted.pop(rid, None)
        return False

    def writes_done(self, request_ids: list[str]) -> None:
        """Their prefill nodes write no more into their blocks: a fenced request's are freed now."""
        for rid in request_ids:
            self.granted.pop(rid, None)
            if rid in self.fenced:
                self.fenced.discard(rid)
                self.node.abort(rid)

    def expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, w in self.waits.items() if now - w.since > WAIT_LIMIT_S]:
            log.warning("[%s] no first token for %.0f s: dropping the push-mode request", rid, WAIT_LIMIT_S)
            self.node.abort(rid)
        passed = [r for r, end in self.granted.items() if end <= now and r not in self.waits]
        self.writes_done(passed)  # (no WRITE can come now: the lease has passed)
