"""The loop shared by prefill and decode nodes: read control messages, step the engine, reply.

One thread at a time owns the engine; transfers report back through hooks the loop polls. The
step itself runs on a worker thread while the loop thread answers pings and holds every other
message until the step ends: a long prefill step (seconds on a loaded CPU) must not read as a
dead node to the router, and nothing else touches the engine while it steps.

Draining: after a Drain message the routers send the node nothing new; it finishes what it holds,
then reports "drained" in its pongs and waits to be stopped, or, for a role switch, leaves its
loop so the process builds the other role's node over the same engine (weights and KV cache,
prefix cache included), control socket and KV event stream.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from typing import TYPE_CHECKING

import zmq

from pdserve.cluster.registration import NodeRegistration
from pdserve.cluster.registry_client import keep_registered
from pdserve.cluster.registry_messages import ACTIVE, DRAINING
from pdserve.cluster.router_liveness import RouterLiveness
from pdserve.engine.engine import LLMEngine
from pdserve.engine.footprint import footprint
from pdserve.node.compat import NodeCompat
from pdserve.node.compute_thread import compute_executor
from pdserve.node.core_board import CoreBoard
from pdserve.node.embedding_intake import EmbeddingIntake
from pdserve.node.embeddings import EmbeddingQueue
from pdserve.node.first_token_clock import FirstTokenClocks
from pdserve.node.kv_events import KVEventPublisher
from pdserve.node.lora_control import apply_lora_message, lora_pong_fields
from pdserve.node.node_stats import NodeStats
from pdserve.node.pong_stats import pong_stats
from pdserve.protocol.outputs import StepOutput
from pdserve.wire.curve_keys import CONTROL_DOMAIN, CurveContext, NodeKeys, node_context
from pdserve.wire.messages import (
    ROLES,
    Abort,
    DecodeRequest,
    Drain,
    EmbedRequest,
    KVSnapshotRequest,
    LoadLoRA,
    Message,
    Ping,
    Pong,
    PrefillRequest,
    TokenDelta,
    TokenDeltas,
    UnloadLoRA,
)
from pdserve.wire.transport import NodeSocket

if TYPE_CHECKING:  # an annotation only: redis-py, which a node without a store never imports (0.1 s of CPU)
    from pdserve.kvstore.embedding_store import EmbeddingStore

log = logging.getLogger(__name__)
IDLE_POLL_MS = 5
# A switching node waits this long after the Drain even when idle: routers that learn of the drain
# from its next pong (every 0.2 s) may still have sent it work meanwhile.
SWITCH_SETTLE_S = 0.5


class NodeRuntime:
    role = "node"
    # CURVE keys (--curve-dir), or None for plain TCP. Set on the class by node_main before the
    # node is built: one node per process, and the role subclasses' constructors stay unchanged.
    curve: NodeKeys | None = None
    # --registry and --advertise-host, set on the class by node_main like curve; the registration
    # is the node process's own and carries over a role switch.
    registry: str | None = None
    advertise_host: str | None = None
    registration: NodeRegistration | None = None
    # Image embeddings from encoder nodes (E/P/D, pdserve.kvstore.embedding_store): set on the
    # class by node_main, like curve, from the node's --store.
    embedding_store: EmbeddingStore | None = None

    def __init__(self, engine: LLMEngine, bind: str | NodeRuntime, node_id: str):
        """bind: the control endpoint, or the node this one takes over from in a role switch (its
        control socket, KV event stream, counters and step thread carry over)."""
        self.engine = engine
        self.node_id = node_id
        self.step_delay_s = 0.0  # fault injection (--step-delay-ms): a pause after each step
        self.compat = NodeCompat(engine)  # what its KV is, in every pong (the router pairs by it)
        self.poller = zmq.Poller()
        if isinstance(bind, NodeRuntime):
            self._take_over(bind)
        else:
            self.ctx = zmq.Context.instance() if self.curve is None else node_context(self.curve)
            self.control = NodeSocket(self.ctx, bind, zap_domain=CONTROL_DOMAIN)
            self.stats = NodeStats()
            self.kv_events = KVEventPublisher(engine.pool, node_id, self.control.send)
            self._stepper = compute_executor()  # the thread that built the engine (one OpenMP pool)
            # The worker writes a byte here when a step ends, so the poll wakes at once.
            self._step_done_r, self._step_done_w = os.pipe()
            self.switches = 0
            self.intake = EmbeddingIntake(node_id, engine, self.ctx, self.embedding_store, self.stats)
            self.cores = CoreBoard.from_env()  # `pdserve up --lend-idle-cores`: idle nodes' cores per step
        self.poller.register(self.control.sock, zmq.POLLIN)
        self.poller.register(self._step_done_r, zmq.POLLIN)
        self.origin: dict[str, bytes] = {}  # request id -> the router that sent it
        self.ttft_clocks = FirstTokenClocks()  # each request's way to its first token here (TTFT breakdown)
        self.embeddings = EmbeddingQueue()  # /v1/embeddings work, computed between steps
        self.routers_seen = RouterLiveness()  # a router that stops pinging died: its requests end
        self._stop = False
        self._held: list[tuple[object, bytes, Message]] = []  # messages that arrived mid-step
        self.drain_to: str | None = None  # None: active; "": drain, then wait to stop; a role: switch
        self.drain_since = 0.0
        self.switch_to: str | None = None  # set when the loop ends for a role switch

    def take_embeddings(self, images, handovers=()) -> None:
        """Images an encoder node encoded go into the engine's encoder cache, READ over NIXL
        (handovers) or loaded from the store, so the engine does not encode them; an image found
        in neither is the engine's to encode."""
        if images:
            self.intake.take(images, handovers)

    def _take_over(self, old: NodeRuntime) -> None:
        self.ctx, self.control, self.stats, self.kv_events = old.ctx, old.control, old.stats, old.kv_events
        self._stepper, self._step_done_r, self._step_done_w = old._stepper, old._step_done_r, old._step_done_w
        self.switches = old.switches + 1
        self.intake, self.cores = old.intake, old.cores
        self.registration = old.registration
        self.step_delay_s = old.step_delay_s

    # ---- the loop -------------------------------------------------------------------------
    def serve_forever(self) -> str | None:
        """Serve until stopped (returns None, everything closed) or until a drain for a role
        switch completes (returns the new role; the shared parts stay open for its node)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self.stop())
        memory = footprint(self.engine)
        log.info("%s %s serving: weights %.1f MB, KV %d bytes per token, resident %.1f MB", self.role,
                 self.node_id, memory["weight_bytes"] / 1e6, memory["kv_bytes_per_token"],
                 memory["resident_bytes"] / 1e6)
        keep_registered(self)
        try:
            while not self._stop and self.switch_to is None:
                self.run_once()
                self._maybe_switch()
        finally:
            if self.switch_to is None:
                self.close()
            else:
                self.close_role()
        return self.switch_to

    def _maybe_switch(self) -> None:
        if (self.drain_to and self.idle() and time.monotonic() - self.drain_since >= SWITCH_SETTLE_S):
            log.info("%s drained: switching from %s to %s", self.node_id, self.role, self.drain_to)
            self.switch_to = self.drain_to

    def run_once(self) -> None:
        # Block on the sockets only when the last step did no work (idle, or all requests are
        # waiting for remote KV): otherwise keep stepping.
        self._read_messages(0 if self._computing() else IDLE_POLL_MS)
        self.poll_background()
        self._abort_for_gone_routers()
        if self.embeddings:
            for identity, result in self._run_answering_pings(lambda: self.embeddings.advance(self.engine)):
                self.control.send(identity, result)
        if self.engine.has_unfinished_requests():
            began = time.perf_counter()
            outputs = self._step_answering_pings()
            self.ttft_clocks.stepped(began)
            self.on_outputs(outputs)
            if self.step_delay_s:
                time.sleep(self.step_delay_s)
        if self.cores is not None and not self._computing():
            self.cores.mark_idle()  # nothing to compute (or only KV to wait for): its cores are lent
        self.kv_events.flush()

    def _computing(self) -> bool:
        """Requests to step, and the last step computed tokens (not only waiting for remote KV)."""
        return self.engine.has_unfinished_requests() and self.engine.last_step_tokens > 0

    def _step_answering_pings(self) -> list[StepOutput]:
        # (a step borrows idle nodes' cores only for a long prompt to compute: core_board)
        sched, tokens, ready = self.engine.scheduler, None, True
        if self.cores is not None:
            tokens, ready = sched.longest_prompt_to_compute(), sched.has_work_ready()
        return self._run_answering_pings(self.engine.step, tokens, lambda: self.engine.last_step_tokens > 0, ready)

    def _run_answering_pings(self, work, prefill_tokens: int | None = None, computed=None, ready: bool = True):
        """work() (an engine step, or other work on the model) on the step thread; its result.
        prefill_tokens: the longest prompt a step has to compute (None: not a step's); computed,
        ready: whether a step computed anything, whether it had anything to (core_board)."""
        step = self._stepper.submit(work if self.cores is None else lambda: self.cores.run(work, prefill_tokens,
                                                                                            computed, ready))
        # Signalled from a done-callback, which runs after the future is marked done: a byte
        # written from inside the step would wake this loop before done() turns true, and the
        # next poll would then sleep its full second with nothing left to wake it.
        step.add_done_callback(lambda _: os.write(self._step_done_w, b"s"))
        while not step.done():
            for sock in dict(self.poller.poll(1000)):
                if sock == self._step_done_r:
                    os.read(self._step_done_r, 64)
                    continue
                while (item := self.socket_for(sock).recv()) is not None:
                    if isinstance(item[1], Ping):
                        self._dispatch(sock, *item)
                    else:
                        self._held.append((sock, *item))
        return step.result()

    def stop(self) -> None:
        self._stop = True

    def _abort_for_gone_routers(self) -> None:
        for identity in self.routers_seen.gone():
            self.kv_events.routers.discard(identity)
            orphans = [rid for rid, sender in self.origin.items() if sender == identity]
            if orphans:
                log.warning("a router stopped pinging: aborting its %d requests", len(orphans))
            for rid in orphans:
                self.abort(rid)

    def _read_messages(self, timeout_ms: int) -> None:
        held, self._held = self._held, []
        for sock, identity, msg in held:
            self._dispatch(sock, identity, msg)
        ready = dict(self.poller.poll(0 if held else timeout_ms))
        for sock in ready:
            if sock == self._step_done_r:
                os.read(self._step_done_r, 64)
                continue
            while (item := self.socket_for(sock).recv()) is not None:
                self._dispatch(sock, *item)

    def socket_for(self, raw) -> NodeSocket:
        return self.control

    def _dispatch(self, raw_sock, identity: bytes, msg: Message) -> None:
        try:
            if isinstance(msg, Ping):
                self.routers_seen.pinged(identity)
                self.socket_for(raw_sock).send(identity, self.pong(msg))
            elif isinstance(msg, KVSnapshotRequest):
                self.kv_events.snapshot(identity)
            elif isinstance(msg, Abort):
                self.abort(msg.request_id)
            elif isinstance(msg, EmbedRequest):
                refused = self.embeddings.add(identity, msg, self.engine)
                if refused is not None:
                    self.control.send(identity, refused)
                self.stats.embedding_requests += 1
            elif isinstance(msg, Drain):
                self.drain(msg)
            elif isinstance(msg, (LoadLoRA, UnloadLoRA)):
                self.control.send(identity, apply_lora_message(self.engine, msg))
            else:
                self.handle(identity, msg)
        except Exception as exc:  # one bad message must not take the node down
            log.exception("failed to handle %s", type(msg).__name__)
            self._answer_failed(identity, msg, f"{self.node_id} failed on it: {type(exc).__name__}: {exc}")

    def _answer_failed(self, identity: bytes, msg: Message, error: str) -> None:
        """A request whose message raised is answered with the error: its router then moves it
        on (another prefill node) or ends it, instead of the client's stream staying silent."""
        try:
            if isinstance(msg, (PrefillRequest, DecodeRequest)):
                self.abort(msg.request_id)
                self.answer_error(identity, msg, error)
        except Exception:
            log.exception("could not answer the failed %s", type(msg).__name__)

    def pong(self, ping: Ping) -> Pong:
        engine = self.engine
        stats = pong_stats(engine, self.stats, self.kv_events.seq, self.integrity_failures(), self.switches,
                           self.cores)
        return Pong(ping.seq, self.node_id, self.role, len(engine.scheduler.requests),
                    engine.pool.num_free, engine.pool.num_blocks, stats,
                    kv_salt=engine.salt, state=self.state(), compat=self.compat.current(), **lora_pong_fields(engine))

    # ---- draining -------------------------------------------------------------------------
    def drain(self, msg: Drain) -> None:
        if msg.cancel:
            if self.drain_to is not None:
                log.info("%s: drain cancelled, active again", self.node_id)
            self.drain_to = None
            self._registered_state(ACTIVE)
            return
        if msg.to_role and (msg.to_role not in ROLES or msg.to_role == self.role):
            log.warning("%s: a %s node cannot switch to role %r", self.node_id, self.role, msg.to_role)
            return
        to_role = msg.to_role
        log.info("%s draining%s", self.node_id, f" to become a {to_role} node" if to_role else "")
        self.drain_to, self.drain_since = to_role, time.monotonic()
        self._registered_state(DRAINING)

    def _registered_state(self, state: str) -> None:
        """Routers that follow the registry learn of the drain from it too."""
        if self.registration is not None:
            self.registration.update(state=state)

    def state(self) -> str:
        if self.drain_to is None:
            return "active"
        return "drained" if self.idle() else "draining"

    def idle(self) -> bool:
        """Nothing in flight: no request, no blocks held for a handover, no transfer."""
        sched = self.engine.scheduler
        return (not sched.requests and not sched.held and not self.origin and not self.embeddings
                and self.role_idle())

    def integrity_failures(self) -> int:
        """KV blocks rejected by a checksum or digest, on every path this node reads (store, NIXL)."""
        sources = (getattr(self, "store", None), self.intake, *self.kv_readers())
        return sum(getattr(src, "integrity_failures", 0) for src in sources if src is not None)

    def kv_readers(self) -> list[object]:
        """The paths besides the store this role reads KV over (a decode node's pullers)."""
        return []

    # ---- hooks ----------------------------------------------------------------------------
    def handle(self, identity: bytes, msg: Message) -> None:
        raise NotImplementedError

    def answer_error(self, identity: bytes, msg: Message, error: str) -> None:
        """The request's error, in the reply its sender waits for (a prefill node's PrefillResult)."""
        self.fail(identity, msg.request_id, error)

    def role_idle(self) -> bool:
        """No role-specific work in flight (pending handovers, pulls)."""
        return True

    def poll_background(self) -> None:
        """Advance transfers, leases and other work that is not an engine step."""

    def abort(self, request_id: str) -> None:
        self.embeddings.abort(request_id)
        self.engine.abort_request(request_id)
        self.origin.pop(request_id, None)
        self.ttft_clocks.forget(request_id)

    def on_outputs(self, outputs: list[StepOutput]) -> None:
        """A step's outputs, one message a router (a lone output as a TokenDelta)."""
        by_router: dict[bytes, list[StepOutput]] = {}
        for out in outputs:
            identity = self.take_delta(out)
            if identity is not None:
                by_router.setdefault(identity, []).append(out)
        for identity, outs in by_router.items():
            self.control.send(identity, TokenDelta(outs[0]) if len(outs) == 1 else TokenDeltas(outs))

    def take_delta(self, out: StepOutput) -> bytes | None:
        """The router an output goes to (None: none waits for it), its bookkeeping done."""
        identity = self.origin.get(out.request_id)
        if out.timing is None:  # its first output from here: where its time went
            out.timing = self.ttft_clocks.first_token(out.request_id)
        if out.finished:
            self.origin.pop(out.request_id, None)
        return identity

    def fail(self, identity: bytes, request_id: str, error: str) -> None:
        log.warning("[%s] failed: %s", request_id, error)
        self.control.send(identity, TokenDelta(StepOutput(request_id, [], "", True, "error", error=error)))
        self.origin.pop(request_id, None)
        self.ttft_clocks.forget(request_id)

    def close_role(self) -> None:
        """Close what belongs to this role alone (its transfer agents and sockets), not what a
        role switch carries over."""

    def close(self) -> None:
        if self.registration is not None:
            self.registration.close()  # deregister first: routers stop sending before the socket closes
        self.close_role()
        self._stepper.submit(lambda: None).result()  # a step in flight ends first; the thread is the process's
        os.close(self._step_done_r)
        os.close(self._step_done_w)
        self.control.close()
        self.intake.close()
        if self.cores is not None:
            self.cores.close()
        store = getattr(self, "store", None)
        if store is not None:
            store.close()
        if isinstance(self.ctx, CurveContext):
            self.ctx.authenticator.stop()
