"""A decode node's push-mode requests (`--handover push`): the router sends the DecodeRequest
beside the PrefillRequest, so the request is admitted and its blocks allocated while the prefill
node computes the prompt; the KVReady that follows brings the first token and the handover, and
the pull starts at once (pdserve.node.decode).

A request waits here between the two messages. One that found no room for its blocks waits with
none allocated and is admitted as a pull-mode request when its KVReady comes (it must not compute
the prompt itself: the prefill node's first token is the one the client gets). A KVReady with no
first token means no prefill node could compute the prompt: the decode node computes it, as it
does a pull-mode request with no handover."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Protocol

from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import RequestStatus
from pdserve.wire.handover import KVHandover
from pdserve.wire.messages import DecodeRequest, KVReady, Message

log = logging.getLogger(__name__)
# A KVReady later than this (the router's prefill timeout and more) will not come: its router
# is gone without a word (a router that stops pinging takes its requests sooner).
WAIT_LIMIT_S = 600.0


class PushHost(Protocol):
    """What of the decode node (pdserve.node.decode) this uses."""
    engine: LLMEngine
    origin: dict[str, bytes]
    placements: dict[str, int]

    def handle(self, identity: bytes, msg: Message) -> None: ...
    def admit_pushed(self, identity: bytes, msg: DecodeRequest, ready: KVReady) -> None: ...
    def release_sender(self, handover: KVHandover, rid: str) -> None: ...
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
        return self.waits.pop(rid, None) is not None

    def expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, w in self.waits.items() if now - w.since > WAIT_LIMIT_S]:
            log.warning("[%s] no first token for %.0f s: dropping the push-mode request", rid, WAIT_LIMIT_S)
            self.node.abort(rid)
