"""The router's view of the cluster: DEALER sockets to every node, health checks, and the
per-request flow prefill -> handover -> decode, relayed as one token stream."""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import zmq
import zmq.asyncio

from pdserve.engine.outputs import StepOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.messages import (Abort, DecodeRequest, KVHandover, Message, Ping, Pong, PrefillRequest,
                              PrefillResult, TokenDelta, decode, encode)
from pdserve.router.backend import BackendError

log = logging.getLogger(__name__)
PING_INTERVAL_S = 0.5
DEAD_AFTER_S = 3.0
PREFILL_TIMEOUT_S = 300.0
TOKEN_TIMEOUT_S = 300.0  # a healthy node that sends nothing for this long still fails the request


@dataclass
class Node:
    node_id: str
    role: str
    address: str
    sock: zmq.asyncio.Socket
    healthy: bool = False
    last_pong: float = 0.0
    stats: dict = field(default_factory=dict)
    requests: set[str] = field(default_factory=set)


class ClusterBackend:
    """GenerationBackend over prefill and decode nodes (prefill_addrs may be empty: then each
    request runs whole on a decode node, the monolithic mode)."""

    def __init__(self, model_name: str, prefill_addrs: list[str], decode_addrs: list[str],
                 transfer: str = "nixl", block_key_fn=None):
        if not decode_addrs:
            raise ValueError("the cluster needs at least one decode node")
        self.model_name = model_name
        self.transfer = transfer
        self.block_key_fn = block_key_fn
        self.ctx = zmq.asyncio.Context.instance()
        self.nodes = [self._connect(f"prefill-{i}", "prefill", a) for i, a in enumerate(prefill_addrs)]
        self.nodes += [self._connect(f"decode-{i}", "decode", a) for i, a in enumerate(decode_addrs)]
        self.streams: dict[str, asyncio.Queue] = {}
        self.prefill_results: dict[str, asyncio.Future] = {}
        self._rr = {"prefill": itertools.count(), "decode": itertools.count()}
        self._tasks: list[asyncio.Task] = []

    def _connect(self, node_id: str, role: str, address: str) -> Node:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        return Node(node_id, role, address, sock)

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._receive(n)) for n in self.nodes]
        self._tasks.append(asyncio.create_task(self._health_loop()))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for n in self.nodes:
            n.sock.close(0)

    # ---- health ---------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        for seq in itertools.count():
            now = time.monotonic()
            for node in self.nodes:
                if node.healthy and now - node.last_pong > DEAD_AFTER_S:
                    self._mark_dead(node)
                await node.sock.send(encode(Ping(seq)))
            await asyncio.sleep(PING_INTERVAL_S)

    def _mark_dead(self, node: Node) -> None:
        node.healthy = False
        log.warning("%s (%s) stopped answering: out of rotation; failing its %d requests",
                    node.node_id, node.address, len(node.requests))
        for rid in list(node.requests):
            self._deliver_error(rid, f"{node.node_id} stopped answering")
        node.requests.clear()

    def _deliver_error(self, rid: str, error: str) -> None:
        fut = self.prefill_results.get(rid)
        if fut is not None and not fut.done():
            fut.set_result(PrefillResult(rid, error=error))
        queue = self.streams.get(rid)
        if queue is not None:
            queue.put_nowait(StepOutput(rid, [], "", True, "error", error=error))

    async def _receive(self, node: Node) -> None:
        while True:
            try:
                msg = decode(await node.sock.recv())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a malformed message is dropped, never fatal
                log.warning("bad message from %s: %s", node.node_id, exc)
                continue
            self._on_message(node, msg)

    def _on_message(self, node: Node, msg: Message) -> None:
        if isinstance(msg, Pong):
            if not node.healthy:
                log.info("%s (%s) is healthy", node.node_id, node.address)
            node.healthy, node.last_pong = True, time.monotonic()
            node.stats = {"requests": msg.num_requests, "free_blocks": msg.free_blocks,
                          "total_blocks": msg.total_blocks, **msg.stats}
        elif isinstance(msg, PrefillResult):
            node.requests.discard(msg.request_id)
            fut = self.prefill_results.get(msg.request_id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, TokenDelta):
            if msg.output.finished:
                node.requests.discard(msg.output.request_id)
            queue = self.streams.get(msg.output.request_id)
            if queue is not None:
                queue.put_nowait(msg.output)

    # ---- requests -------------------------------------------------------------------------
    def _pick(self, role: str) -> Node:
        healthy = [n for n in self.nodes if n.role == role and n.healthy]
        if not healthy:
            raise BackendError(f"no healthy {role} node")
        return healthy[next(self._rr[role]) % len(healthy)]

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[StepOutput]:
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[request_id] = queue
        try:
            first_ids, handover = [], None
            if any(n.role == "prefill" for n in self.nodes):
                first, handover = await self._prefill(request_id, prompt_token_ids, params)
                yield first
                if first.finished:
                    return
                first_ids = first.new_token_ids
            decode_node = self._pick("decode")
            decode_node.requests.add(request_id)
            await decode_node.sock.send(encode(DecodeRequest(request_id, prompt_token_ids, params,
                                                             first_ids, handover)))
            async for out in self._relay(queue, request_id):
                yield out
        finally:
            self.streams.pop(request_id, None)

    async def _prefill(self, rid: str, prompt: list[int], params: SamplingParams
                       ) -> tuple[StepOutput, KVHandover | None]:
        node = self._pick("prefill")
        fut = asyncio.get_running_loop().create_future()
        self.prefill_results[rid] = fut
        node.requests.add(rid)
        if self.block_key_fn is not None:
            keys = self.block_key_fn(prompt)
            log.info("[%s] %d tokens, %d blocks, prefill on %s", rid, len(prompt), len(keys), node.node_id)
        try:
            await node.sock.send(encode(PrefillRequest(rid, prompt, params, self.transfer)))
            result = await asyncio.wait_for(fut, PREFILL_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise BackendError(f"prefill on {node.node_id} timed out") from None
        finally:
            self.prefill_results.pop(rid, None)
            node.requests.discard(rid)
        if result.error is not None or result.first is None:
            raise BackendError(f"prefill failed: {result.error}")
        return result.first, result.handover

    async def _relay(self, queue: asyncio.Queue, rid: str) -> AsyncIterator[StepOutput]:
        while True:
            try:
                async with asyncio.timeout(TOKEN_TIMEOUT_S):  # cheaper than wait_for: no task per token
                    out: StepOutput = await queue.get()
            except TimeoutError:
                await self.abort(rid)
                raise BackendError(f"no tokens for {TOKEN_TIMEOUT_S:.0f} s") from None
            if out.finish_reason == "error":
                raise BackendError(out.error or "generation failed")
            yield out
            if out.finished:
                return

    async def abort(self, request_id: str) -> None:
        for node in self.nodes:
            if node.healthy:
                await node.sock.send(encode(Abort(request_id)))
            node.requests.discard(request_id)

    async def health(self) -> dict:
        nodes = [{"id": n.node_id, "role": n.role, "address": n.address, "healthy": n.healthy, **n.stats}
                 for n in self.nodes]
        healthy = any(n.healthy and n.role == "decode" for n in self.nodes) and (
            all(n.role != "prefill" for n in self.nodes) or any(n.healthy and n.role == "prefill" for n in self.nodes))
        return {"healthy": healthy, "transfer": self.transfer, "nodes": nodes}
