"""A node that decodes streams with an inter-token latency target holds it while it prefills: each
step takes only the prompt tokens the tightest target leaves after the decode rows
(pdserve.engine.tpot_budget), from step costs the node measures on its own steps.

A mixin over NodeRuntime, shared by decode nodes and by prefill nodes that serve whole requests
(the router's monolithic fallback under --prefill-placement slo): on a prefill node the cap then
also holds the prompts it prefills for others, so its own streams stay on target."""
from __future__ import annotations

import time

from pdserve.engine.tpot_budget import StepCostModel, StepCosts, prefill_tokens_per_step
from pdserve.node.runtime import NodeRuntime


class StepBudget(NodeRuntime):
    def init_step_budget(self) -> None:
        self.step_costs = StepCostModel()
        self.itl_targets: dict[str, float] = {}  # request id -> its ITL target (seconds)
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
        self._prefill_cap = prefill_tokens_per_step(rows, self._costs(), min(self.itl_targets.values()),
                                                    self.engine.config.max_num_batched_tokens)
        return self._prefill_cap

    def _step_answering_pings(self):
        t0 = time.perf_counter()
        outputs = super()._step_answering_pings()
        tokens, prefill = self.engine.last_step_tokens, self.engine.scheduler.step_prefill_tokens
        if tokens:
            self.step_costs.observe(tokens - prefill, prefill, time.perf_counter() - t0)
        return outputs

    def budget_stats(self) -> dict:
        costs = self._costs()
        return dict(step_base_us=int(costs.base_s * 1e6), decode_row_us=int(costs.row_s * 1e6),
                    mixed_prefill_ns_per_token=int(costs.token_s * 1e9), prefill_cap_tokens=self._prefill_cap,
                    max_num_batched_tokens=self.engine.config.max_num_batched_tokens)

    def reply_delta(self, out) -> None:
        if out.finished:
            self.itl_targets.pop(out.request_id, None)
        super().reply_delta(out)

    def fail(self, identity: bytes, request_id: str, error: str) -> None:
        self.itl_targets.pop(request_id, None)
        super().fail(identity, request_id, error)

    def abort(self, request_id: str) -> None:
        self.itl_targets.pop(request_id, None)
        super().abort(request_id)
