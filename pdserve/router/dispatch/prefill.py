"""The prefill half of ClusterBackend's request flow: count where the plan put the prompt, send
it to a prefill node, wait for its first token and handover, and retry on another node when one
fails (with none left, the decode node prefills the prompt itself). A mixin so cluster.py keeps one job: the
request's path from plan to relayed stream."""
from __future__ import annotations

import asyncio
import logging

from pdserve.protocol.outputs import StepOutput
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.router.dispatch.backend import BackendError
from pdserve.router.dispatch.failover import MAX_ATTEMPTS, PREFILL_TIMEOUT_S, NodeLost
from pdserve.router.dispatch.metrics import RequestTimer
from pdserve.router.dispatch.nodes import Node
from pdserve.router.placement.policy import RoutePlan
from pdserve.router.routes.tenants import NO_SCOPE, KVScope
from pdserve.wire.handover import KVHandover
from pdserve.wire.messages import Abort, PrefillRequest

log = logging.getLogger("pdserve.router.dispatch.cluster")


class PrefillDispatch:
    """Uses ClusterBackend's pool, adapters, counters, metrics, prefill_results, owner,
    transfer, _preferred and _pick."""

    def _placed(self, plan: RoutePlan) -> str:
        if plan.prefill is not None:
            return "placed_remote"
        node = self.pool.get(plan.decode)
        return "placed_whole" if node is not None and node.role == "prefill" else "placed_local"

    def _queue_local(self, plan: RoutePlan, rid: str, prompt_len: int) -> None:
        """The decode node prefills this prompt: its tokens count as queued there until the first
        token (the decision's estimate of that node's prefill queue). On a prefill node (a whole
        request) it also counts as a stream decoding there until it ends."""
        node = self.pool.get(plan.decode)
        if node is not None:
            node.queued_tokens[rid] = max(prompt_len - plan.decode_cached_tokens, 1)
            if node.role == "prefill":
                node.whole.add(rid)

    def _unplace_whole(self, node_id: str, rid: str) -> None:
        node = self.pool.get(node_id)
        if node is not None:
            node.whole.discard(rid)

    def _unqueue_local(self, node_id: str, rid: str) -> None:
        node = self.pool.get(node_id)
        if node is not None:
            node.queued_tokens.pop(rid, None)

    async def _send_adapter_first(self, node: Node, adapter: str | None) -> None:
        """A node that may lack the request's adapter is told to load it first (it reads its
        messages in order, so it has it when the request arrives)."""
        load = self.adapters.before_request(node, adapter)
        if load is not None:
            await self.pool.send(node, load)

    async def _prefill_with_retry(self, rid: str, prompt: list[int], params: SamplingParams, timer: RequestTimer,
                                  preferred: str | None = None, scope: KVScope = NO_SCOPE
                                  ) -> tuple[StepOutput | None, KVHandover | None]:
        """The first token and the handover; (None, None) when no prefill node can do it, so the
        decode node prefills the prompt itself."""
        tried: set[str] = set()
        for attempt in range(MAX_ATTEMPTS):
            node = self._preferred(preferred, tried) or self._pick("prefill", tried)
            if node is None:
                break
            tried.add(node.node_id)
            if attempt == 0:
                timer.dispatched()
            try:
                return await self._prefill(rid, prompt, params, node, scope)
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

    async def _prefill(self, rid: str, prompt: list[int], params: SamplingParams, node: Node,
                       scope: KVScope = NO_SCOPE) -> tuple[StepOutput, KVHandover | None]:
        fut = asyncio.get_running_loop().create_future()
        self.prefill_results[rid] = fut
        self.owner[rid] = node.node_id
        node.requests.add(rid)
        node.queued_tokens[rid] = len(prompt)
        log.debug("[%s] %d tokens, prefill on %s", rid, len(prompt), node.node_id)
        try:
            await self._send_adapter_first(node, scope.adapter)
            await self.pool.send(node, PrefillRequest(rid, prompt, params, self.transfer,
                                                      cache_salt=scope.cache_salt, adapter=scope.adapter))
            result = await asyncio.wait_for(fut, PREFILL_TIMEOUT_S)
        except asyncio.TimeoutError:
            self.pool.mark_dead(node, f"did not answer a prefill in {PREFILL_TIMEOUT_S:.0f} s")
            raise NodeLost(node.node_id) from None
        finally:
            self.prefill_results.pop(rid, None)
            node.requests.discard(rid)
            node.queued_tokens.pop(rid, None)
        if result.error is not None or result.first is None:
            raise BackendError(f"prefill failed: {result.error}")
        return result.first, result.handover
