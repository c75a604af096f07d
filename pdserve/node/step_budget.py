"""A node that decodes streams with an inter-token latency target holds it while it prefills: each
step takes only the prompt tokens its streams can absorb. TPOT is a stream's mean inter-token
time, so a stream that decodes faster than its target banks time a prefill may spend; each
stream's clock (tpot_budget.StreamClock) counts what it has banked and will bank over the tokens
it has left, and the step takes what the least of them allows, at the cost per prompt token the
node measures on its own steps (at least a 16-token chunk, so a prefill always progresses).

A mixin over NodeRuntime, shared by decode nodes and by prefill nodes that serve whole requests
(the router's monolithic fallback under --prefill-placement slo): on a prefill node the cap then
also holds the prompts it prefills for others, so its own streams stay on target."""
from __future__ import annotations

import time

from pdserve.node.runtime import NodeRuntime
from pdserve.protocol.tpot_budget import (
    STREAM_TOKENS_CAP,
    StepCostModel,
    StepCosts,
    StreamClock,
    amortized_prefill_tokens,
    least_allowance_s,
)


class StepBudget(NodeRuntime):
    def init_step_budget(self) -> None:
        self.step_costs = StepCostModel()
        self.itl_targets: dict[str, float] = {}  # request id -> its ITL target (seconds)
        self.clocks: dict[str, StreamClock] = {}  # request id -> its budget, from its first token here
        self._prefill_cap = 0
        self.engine.scheduler.prefill_budget = self._prefill_tokens

    def close_step_budget(self) -> None:
        self.engine.scheduler.prefill_budget = None  # the engine may serve another role next

    def hold_itl_target(self, request_id: str, itl_s: float) -> None:
        if itl_s > 0:
            self.itl_targets[request_id] = itl_s

    def _costs(self) -> StepCosts:
        costs = self.step_costs.costs()
        if costs.token_s == 0 and self.engine.prefill_s_per_token > 0:  # no mixed step yet
            costs = StepCosts(costs.base_s, costs.row_s, self.engine.prefill_s_per_token)
        return costs

    def _prefill_tokens(self, rows: int) -> int | None:
        """The scheduler's cap on this step's prompt tokens (None: no request here has a target)."""
        if not self.itl_targets:
            self._prefill_cap = 0
            return None
        self._prefill_cap = amortized_prefill_tokens(list(self.clocks.values()), time.monotonic(), rows,
                                                     self._costs(), self.engine.config.max_num_batched_tokens)
        return self._prefill_cap

    def _tick_clock(self, out) -> None:
        """Start a stream's clock at its first token here; count its tokens after."""
        rid = out.request_id
        clock = self.clocks.get(rid)
        if clock is not None:
            clock.tokens += len(out.new_token_ids)
            return
        req = self.engine.scheduler.requests.get(rid)
        if req is None or not out.new_token_ids:
            return
        left = (req.sampling_params.max_tokens or STREAM_TOKENS_CAP) - len(req.output_token_ids)
        self.clocks[rid] = StreamClock(self.itl_targets[rid], time.monotonic(), min(left, STREAM_TOKENS_CAP))

    def _step_answering_pings(self):
        t0 = time.perf_counter()
        outputs = super()._step_answering_pings()
        tokens, prefill = self.engine.last_step_tokens, self.engine.scheduler.step_prefill_tokens
        if tokens:
            self.step_costs.observe(tokens - prefill, prefill, time.perf_counter() - t0)
        return outputs

    def budget_stats(self) -> dict:
        costs = self._costs()
        stats = dict(step_base_us=int(costs.base_s * 1e6), decode_row_us=int(costs.row_s * 1e6),
                     mixed_prefill_ns_per_token=int(costs.token_s * 1e9), prefill_cap_tokens=self._prefill_cap,
                     max_num_batched_tokens=self.engine.config.max_num_batched_tokens, timed_streams=len(self.clocks))
        if self.clocks:  # the prefill time its streams can still absorb (negative: they are behind)
            slack_s = least_allowance_s(list(self.clocks.values()), time.monotonic(), costs.step_s(len(self.clocks), 0))
            stats["stream_slack_us"] = int(slack_s * 1e6)
        return stats

    def take_delta(self, out) -> bytes | None:
        if out.finished:
            self._forget(out.request_id)
        elif out.request_id in self.itl_targets:
            self._tick_clock(out)
        return super().take_delta(out)

    def _forget(self, request_id: str) -> None:
        self.itl_targets.pop(request_id, None)
        self.clocks.pop(request_id, None)

    def fail(self, identity: bytes, request_id: str, error: str) -> None:
        self._forget(request_id)
        super().fail(identity, request_id, error)

    def abort(self, request_id: str) -> None:
        self._forget(request_id)
        super().abort(request_id)
