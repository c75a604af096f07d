"""The loop shared by prefill and decode nodes: read control messages, step the engine, reply.

One thread at a time owns the engine; transfers report back through hooks the loop polls. The
step itself runs on a worker thread while the loop thread answers pings and holds every other
message until the step ends: a long prefill step (seconds on a loaded CPU) must not read as a
dead node to the router, and nothing else touches the engine while it steps.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import zmq

from pdserve.cluster.registration import NodeRegistration, keep_registered
from pdserve.curve_keys import CONTROL_DOMAIN, CurveContext, NodeKeys, node_context
from pdserve.engine.engine import LLMEngine
from pdserve.engine.outputs import StepOutput
from pdserve.kv_events import KVEventPublisher
from pdserve.messages import Abort, KVSnapshotRequest, Message, Ping, Pong, TokenDelta
from pdserve.transport import NodeSocket

log = logging.getLogger(__name__)
IDLE_POLL_MS = 5


@dataclass
class NodeStats:
    requests_total: int = 0
    transfers_ok: int = 0
    transfers_failed: int = 0
    leases_expired: int = 0
    cached_tokens_store: int = 0   # prompt tokens loaded from the KV store instead of computed
    transfer_bytes_nixl: int = 0
    transfer_bytes_store: int = 0
    transfer_us_nixl: int = 0      # microseconds spent in KV transfers (pulls, store puts)
    transfer_us_store: int = 0
    store_load_us: int = 0         # microseconds spent loading prompt blocks from the store


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

    def __init__(self, engine: LLMEngine, bind: str, node_id: str):
        self.engine = engine
        self.node_id = node_id
        self.ctx = zmq.Context.instance() if self.curve is None else node_context(self.curve)
        self.control = NodeSocket(self.ctx, bind, zap_domain=CONTROL_DOMAIN)
        self.poller = zmq.Poller()
        self.poller.register(self.control.sock, zmq.POLLIN)
        self.origin: dict[str, bytes] = {}  # request id -> the router that sent it
        self.stats = NodeStats()
        self.kv_events = KVEventPublisher(engine.pool, node_id, self.control.send)
        self._stop = False
        self._stepper = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{node_id}-step")
        # The worker writes a byte here when a step ends, so the poll wakes at once.
        self._step_done_r, self._step_done_w = os.pipe()
        self.poller.register(self._step_done_r, zmq.POLLIN)
        self._held: list[tuple[object, bytes, Message]] = []  # messages that arrived mid-step

    # ---- the loop -------------------------------------------------------------------------
    def serve_forever(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self.stop())
        log.info("%s %s serving", self.role, self.node_id)
        keep_registered(self)
        try:
            while not self._stop:
                self.run_once()
        finally:
            self.close()

    def run_once(self) -> None:
        # Block on the sockets only when the last step did no work (idle, or all requests are
        # waiting for remote KV): otherwise keep stepping.
        busy = self.engine.has_unfinished_requests() and self.engine.last_step_tokens > 0
        self._read_messages(0 if busy else IDLE_POLL_MS)
        self.poll_background()
        if self.engine.has_unfinished_requests():
            self.on_outputs(self._step_answering_pings())
        self.kv_events.flush()

    def _step_answering_pings(self) -> list[StepOutput]:
        step = self._stepper.submit(self.engine.step)
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
                self.socket_for(raw_sock).send(identity, self.pong(msg))
            elif isinstance(msg, KVSnapshotRequest):
                self.kv_events.snapshot(identity)
            elif isinstance(msg, Abort):
                self.abort(msg.request_id)
            else:
                self.handle(identity, msg)
        except Exception:  # one bad message must not take the node down
            log.exception("failed to handle %s", type(msg).__name__)

    def pong(self, ping: Ping) -> Pong:
        stats = {k: v for k, v in dataclasses.asdict(self.stats).items() if isinstance(v, int)}
        engine, sched = self.engine, self.engine.scheduler
        stats.update(kv_blocks_in_use=engine.pool.num_used, running=len(sched.running),
                     waiting=len(sched.waiting), preemptions=sched.num_preemptions,
                     cached_tokens=engine.cached_prompt_tokens, computed_tokens=engine.computed_prompt_tokens,
                     cached_tokens_local=max(engine.cached_prompt_tokens - self.stats.cached_tokens_store, 0),
                     cached_blocks=len(engine.pool.cached), kv_event_seq=self.kv_events.seq,
                     prefill_ns_per_token=int(engine.prefill_s_per_token * 1e9),
                     integrity_failures=self.integrity_failures())
        return Pong(ping.seq, self.node_id, self.role, len(sched.requests),
                    engine.pool.num_free, engine.pool.num_blocks, stats,
                    kv_salt=engine.salt)

    def integrity_failures(self) -> int:
        """KV blocks rejected by a checksum or digest, on every path this node reads (store, NIXL)."""
        sources = (getattr(self, "store", None), getattr(self, "nixl", None))
        return sum(getattr(src, "integrity_failures", 0) for src in sources if src is not None)

    # ---- hooks ----------------------------------------------------------------------------
    def handle(self, identity: bytes, msg: Message) -> None:
        raise NotImplementedError

    def poll_background(self) -> None:
        """Advance transfers, leases and other work that is not an engine step."""

    def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self.origin.pop(request_id, None)

    def on_outputs(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            self.reply_delta(out)

    def reply_delta(self, out: StepOutput) -> None:
        identity = self.origin.get(out.request_id)
        if identity is not None:
            self.control.send(identity, TokenDelta(out))
        if out.finished:
            self.origin.pop(out.request_id, None)

    def fail(self, identity: bytes, request_id: str, error: str) -> None:
        log.warning("[%s] failed: %s", request_id, error)
        self.control.send(identity, TokenDelta(StepOutput(request_id, [], "", True, "error", error=error)))
        self.origin.pop(request_id, None)

    def close(self) -> None:
        if self.registration is not None:
            self.registration.close()  # deregister first: routers stop sending before the socket closes
        self._stepper.shutdown(wait=True)
        os.close(self._step_done_r)
        os.close(self._step_done_w)
        self.control.close()
        if isinstance(self.ctx, CurveContext):
            self.ctx.authenticator.stop()

