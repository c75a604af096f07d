"""The prefill half of a request's path: send the prompt to a prefill node, wait for its first
token and handover, and retry on another node when one fails (with none left, the decode node
prefills the prompt itself)."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from pdserve.protocol.outputs import StepOutput
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.router.dispatch.adapters import RouterAdapters
from pdserve.router.dispatch.backend import BackendError
from pdserve.router.dispatch.failover import HANDOVER_TIMEOUT_S, MAX_ATTEMPTS, PREFILL_TIMEOUT_S, NodeLost
from pdserve.router.dispatch.inflight import Inflight
from pdserve.router.dispatch.metrics import RequestTimer, RouterMetrics
from pdserve.router.dispatch.nodes import Node, NodePool
from pdserve.router.dispatch.picker import NodePicker
from pdserve.router.placement.keys import NO_SCOPE, KVScope
from pdserve.wire.embedding_handover import EmbeddingHandover
from pdserve.wire.handover import KVHandover
from pdserve.wire.messages import Abort, PrefillRequest

log = logging.getLogger("pdserve.router.dispatch.cluster")


@dataclass
class PrefillDispatch:
    pool: NodePool
    inflight: Inflight
    picker: NodePicker
    adapters: RouterAdapters
    metrics: RouterMetrics
    transfer: str  # how handovers travel: the router's --kv-transfer ("nixl" or "store")
    # local_prefills: prompts the decode node prefilled after every prefill node failed them
    counters: dict[str, int] = field(default_factory=lambda: {"prefill_retries": 0, "local_prefills": 0})
    # handovers after their first token (push mode; a store put in pull mode too): their nodes
    following: dict[str, Node] = field(default_factory=dict)

    async def prefill(self, rid: str, prompt: list[int], params: SamplingParams, timer: RequestTimer,
                      preferred: str | None = None, scope: KVScope = NO_SCOPE,
                      embeddings: list[EmbeddingHandover] | None = None, decode_holds: int = 0,
                      push: bool = False, decode_lends: bool = False) -> tuple[StepOutput | None, KVHandover | None]:
        """The first token and the handover; (None, None) when no prefill node can do it, so the
        decode node prefills the prompt itself. embeddings: where an encoder node's NIXL READs wait.
        decode_holds: leading prompt tokens the decode node holds (their blocks are not handed over).
        push: its decode node waits already; a NIXL handover whose WriteTarget had not come then
        comes after the first token. A store handover does in either mode (handover None here;
        follows() says so, follow() waits for it). decode_lends: the decode node was asked to
        lend its blocks after the prefill node's (DecodeRequest.lend_from_tokens)."""
        tried: set[str] = set()
        for attempt in range(MAX_ATTEMPTS):
            node = self.picker.preferred(preferred, tried) or self.picker.pick("prefill", tried)
            if node is None:
                break
            tried.add(node.node_id)
            if attempt == 0:
                timer.dispatched()
            try:
                return await self._prefill_on(node, rid, prompt, params, scope, embeddings or [], decode_holds, push,
                                              decode_lends)
            except (NodeLost, BackendError) as exc:
                await self.pool.send(node, Abort(rid))  # a hung node that comes back drops it
                self.counters["prefill_retries"] += 1
                self.metrics.retries.labels("prefill").inc()
                if isinstance(exc, NodeLost):
                    self.metrics.failovers.labels("prefill").inc()
                log.warning("[%s] prefill on %s failed (%s): attempt %d of %d", rid, node.node_id, exc,
                            attempt + 1, MAX_ATTEMPTS)
        self.counters["local_prefills"] += 1
        log.info("[%s] no prefill node could take it: the decode node prefills", rid)
        return None, None

    async def _prefill_on(self, node: Node, rid: str, prompt: list[int], params: SamplingParams,
                          scope: KVScope = NO_SCOPE, embeddings: list[EmbeddingHandover] | None = None,
                          decode_holds: int = 0, push: bool = False, decode_lends: bool = False
                          ) -> tuple[StepOutput, KVHandover | None]:
        fut = self.inflight.expect_reply(rid, node)
        follows = push or self.transfer == "store"  # a store put follows the first token in either mode
        if follows:  # registered before the prompt goes: its HandoverMade may come right after the token
            self.inflight.expect_handover(rid, node)
        node.requests.add(rid)
        node.queued_tokens[rid] = len(prompt)
        log.debug("[%s] %d tokens, prefill on %s", rid, len(prompt), node.node_id)
        try:
            await self.adapters.send_ahead(node, scope.adapter)
            await self.pool.send(node, PrefillRequest(rid, prompt, params, self.transfer,
                                                      cache_salt=scope.cache_salt, adapter=scope.adapter,
                                                      images=list(scope.images), embeddings=embeddings or [],
                                                      decode_holds_tokens=decode_holds, push=push,
                                                      put_after_token=follows and not push,
                                                      decode_lends=decode_lends))
            # A WriteTarget that comes from now on is forwarded there, also after the first token (a
            # node that computes the prompt no more declines it: the decode node frees its blocks).
            self.inflight.prefilling[rid] = node.node_id
            if (target := self.inflight.write_targets.get(rid)) is not None:
                await self.pool.send(node, target)
            result = await asyncio.wait_for(fut, PREFILL_TIMEOUT_S)
        except asyncio.TimeoutError:
            self.pool.mark_dead(node, f"did not answer a prefill in {PREFILL_TIMEOUT_S:.0f} s", "silent")
            raise NodeLost(node.node_id) from None
        finally:
            self.inflight.drop_reply(rid)
            node.queued_tokens.pop(rid, None)
            result = fut.result() if fut.done() and not fut.cancelled() and fut.exception() is None else None
            if result is not None and result.handover_follows and result.first is not None:
                self.following[rid] = node  # still on the node until its handover comes
            else:
                self.inflight.drop_handover(rid)
                node.requests.discard(rid)
        if result.error is not None or result.first is None:
            raise BackendError(f"prefill failed: {result.error}")
        return result.first, result.handover

    def follows(self, rid: str) -> bool:
        """Whether rid's handover comes after its first token (follow() waits for it)."""
        return rid in self.following

    def forget(self, rid: str) -> None:
        """The request ended without waiting for its handover to follow (its client left)."""
        node = self.following.pop(rid, None)
        if node is not None:
            node.requests.discard(rid)

    async def follow(self, rid: str) -> KVHandover | None:
        """A handover made after its first token (push mode, a store put); None when there
        is none to wait for, or its node was lost or stayed silent (the decode node then computes
        the prompt)."""
        node = self.following.pop(rid, None)
        fut = self.inflight.handovers.get(rid)
        if node is None or fut is None:
            return None
        try:
            return await asyncio.wait_for(fut, HANDOVER_TIMEOUT_S)
        except (NodeLost, asyncio.TimeoutError) as exc:
            log.warning("[%s] no handover from %s (%s): its decode node computes the prompt", rid, node.node_id,
                        type(exc).__name__)
            return None
        finally:
            self.inflight.drop_handover(rid)
            node.requests.discard(rid)
