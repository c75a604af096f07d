"""A push-mode prompt's prefix READ from its decode node instead of computed (`--handover push`
over NIXL): only the missing suffix is computed.

A conversation's next turn resends its history. The decode node that served the last turn holds
all of it, the earlier prompt and the answer it generated; this node holds the earlier prompt
(it computed it) but not the answer, which it used to recompute. The router says how many
tokens the decode node holds (PrefillRequest.decode_holds_tokens) and asks that node to lend
its blocks after the ones this node holds (DecodeRequest.lend_from_tokens): its WriteTarget
names them (WriteTarget.held, with their digests), under the lease its own blocks have.

Such a request is admitted waiting for those tokens (WAITING_FOR_REMOTE_KVS, as a stored prefix
waits for its load). When the target comes, the lent blocks this node lacks are READ into the
request's blocks and checked against their digests; then the request computes the rest, and the
writer WRITEs only the blocks after the decode node's. A target that lends less than awaited, a
READ or digest that fails, or no target in time: the request computes the whole prompt, as
before. In time is while waiting still beats computing: no longer than this node takes to compute
the tokens awaited (prefill_s_per_token), at most TARGET_WAIT_S. The decode node answers a push
only between its steps, and one in a long step (a prompt it computes itself) held the prompt
here for up to TARGET_WAIT_S to save a fraction of that: waiting no longer than the compute it
saves costs at most twice the better choice, whenever the target comes. The decode node's
request holds the lent blocks (its prefix cache's) until the writes end or its lease passes, so
a READ within the lease reads them whole.
"""
from __future__ import annotations

import logging
import time

from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import Request, RequestStatus
from pdserve.kvstore.block_digest import mismatched_blocks
from pdserve.kvstore.nixl_transfer import NixlKVAgent, NixlTransferError
from pdserve.node.node_stats import NodeStats
from pdserve.wire.messages import PrefillRequest, WriteTarget

log = logging.getLogger(__name__)
TARGET_WAIT_S = 2.0  # the decode node's target comes with its admission: after its step, or never if it is lost
# ... but at least this long: the target comes after the decode node's step in progress and two
# hops through the router, and a wait shorter than that would seldom see one on a loaded machine
MIN_WAIT_S = 0.25
# The READ runs on the node's loop thread (over cma: inside the post itself), as push mode's WRITEs
# do (push_writes.WRITE_TIMEOUT_S): a dead peer must not hold the loop past the router's pings.
READ_TIMEOUT_S = 0.5


class BorrowedPrefix:
    def __init__(self, engine: LLMEngine, agent: NixlKVAgent, stats: NodeStats):
        self.engine, self.agent, self.stats = engine, agent, stats
        self.waiting: dict[str, tuple[int, float, float]] = {}  # request id -> (tokens awaited, since, until)

    def tokens_to_borrow(self, msg: PrefillRequest, stored: int) -> int:
        """Leading prompt tokens worth awaiting from the decode node (whole blocks before the last
        prompt token, which is always computed); 0: none (the router asked the decode node for no
        lend, a stored prefix loads instead, or a model with recurrent state, whose state is not lent)."""
        if not msg.decode_lends or msg.transfer != "nixl" or stored or self.engine.kv.states is not None:
            return 0
        bs = self.engine.config.block_size
        return min(msg.decode_holds_tokens, len(msg.prompt_token_ids) - 1) // bs * bs

    def await_target(self, req: Request, tokens: int) -> None:
        """The request waits for `tokens` (it is WAITING_FOR_REMOTE_KVS: its own cache held fewer),
        for as long as computing the ones it lacks would take (module doc)."""
        now, per_token = time.monotonic(), self.engine.prefill_s_per_token
        wait_s = TARGET_WAIT_S if per_token <= 0 else (tokens - req.num_computed_tokens) * per_token
        self.waiting[req.request_id] = (tokens, now, now + min(max(wait_s, MIN_WAIT_S), TARGET_WAIT_S))

    def take(self, target: WriteTarget, peer: str) -> bool | None:
        """READ what the target lends into its waiting request (peer: the decode node's agent,
        loaded by the writer; "" when it cannot be reached); whether it landed, None when no
        request of this node waits for it."""
        rid = target.request_id
        if rid not in self.waiting:
            return None
        tokens, since, _ = self.waiting.pop(rid)
        self.stats.kv_borrow_wait_us += int((time.monotonic() - since) * 1e6)
        req = self.engine.scheduler.requests.get(rid)
        if req is None or req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            return None
        ok = bool(peer) and self._read(req, target, peer, tokens)
        self._landed(req, ok, tokens)
        return ok

    def expire(self) -> None:
        """Requests whose target did not come in time compute their whole prompt."""
        now = time.monotonic()
        for rid in [r for r, (_, _, until) in self.waiting.items() if now > until]:
            tokens, since, _ = self.waiting.pop(rid)
            self.stats.kv_borrow_wait_us += int((now - since) * 1e6)
            log.info("[%s] no WriteTarget in %.2f s: computing the %d tokens it would lend", rid, now - since, tokens)
            req = self.engine.scheduler.requests.get(rid)
            if req is not None:
                self._landed(req, False, tokens)

    def forget(self, rid: str) -> None:
        self.waiting.pop(rid, None)

    def _read(self, req: Request, target: WriteTarget, peer: str, tokens: int) -> bool:
        bs = self.engine.config.block_size
        first, last = max(req.num_computed_tokens // bs, req.num_slid_blocks), tokens // bs
        lent_to = target.held_from + len(target.held)
        if first >= last:
            return True  # (this node's own cache held them by now)
        if target.held_from > first or lent_to < last or len(target.held_digests) != len(target.held):
            return False  # (it lends less than the router said the decode node holds)
        at = slice(first - target.held_from, last - target.held_from)
        ids = req.block_ids[first:last]
        try:
            handle = self.agent.start_read(peer, target.held[at], ids, timeout_s=READ_TIMEOUT_S)
            self.agent.wait(handle)
        except (NixlTransferError, ValueError) as exc:
            log.warning("[%s] READ of the decode node's blocks failed (computing them): %s", req.request_id, exc)
            return False
        if mismatched_blocks(self.engine.kv_cache, ids, target.held_digests[at]):
            log.warning("[%s] the decode node's lent blocks failed their digest check: computing them", req.request_id)
            return False
        self.stats.transfer_bytes_nixl += handle.nbytes
        self.stats.kv_tokens_borrowed += (last - first) * bs
        return True

    def _landed(self, req: Request, ok: bool, tokens: int) -> None:
        self.stats.kv_borrow_failures += not ok
        self.engine.report_remote_kv(req.request_id, ok=ok, cached_tokens=tokens)
