"""The SLA planner in the router: each interval, read what this router measured, ask the planner
(pdserve.cluster.planner), log the decision with its reasons, export it in /metrics, and carry it
out through the Scaler (a role switch, or a scale through the node owner).

Latency percentiles come from the router's own histograms: the difference of two scrapes' bucket
counts is the interval's histogram, and its p90 is the upper bound of the bucket holding it.
"""
from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import Counter, Gauge, Histogram

from pdserve.cluster.planner import Decision, PoolSnapshot, SlaPlanner
from pdserve.router.dispatch.metrics import RouterMetrics
from pdserve.router.scaling.scaler import ScaleError, Scaler
from pdserve.wire.messages import ROLES

log = logging.getLogger(__name__)


def _counter_value(counter: Counter) -> float:
    return next((s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total")), 0.0)


def bucket_counts(hist: Histogram) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of each bucket, in order."""
    samples = [s for metric in hist.collect() for s in metric.samples if s.name.endswith("_bucket")]
    return [(float(s.labels["le"]), s.value) for s in samples]


def interval_quantile(before: list[tuple[float, float]], after: list[tuple[float, float]], q: float) -> float | None:
    """The q-quantile of what was observed between two bucket snapshots (None: nothing was)."""
    counts = [(le, a - (before[i][1] if before else 0.0)) for i, (le, a) in enumerate(after)]
    total = counts[-1][1] if counts else 0.0
    if total <= 0:
        return None
    finite = [le for le, _ in counts if le != float("inf")]
    for le, cumulative in counts:
        if cumulative >= q * total:
            return le if le != float("inf") else finite[-1] * 2  # past the last bound: say so
    return None


class PlannerLoop:
    def __init__(self, metrics: RouterMetrics, scaler: Scaler, planner: SlaPlanner, interval_s: float = 5.0):
        self.metrics = metrics  # the router's latency histograms and prompt token count
        self.scaler = scaler  # what it acts through
        self.planner = planner
        self.interval_s = interval_s
        self.decisions: list[Decision] = []
        self._task: asyncio.Task | None = None
        self._last = {"ttft": bucket_counts(metrics.ttft), "itl": bucket_counts(metrics.itl)}
        self._last_prompt_tokens, self._last_time = _counter_value(metrics.prompt_tokens), time.monotonic()
        r = metrics.registry
        self.target = Gauge("pdserve_planner_target_nodes", "nodes per role the planner wants", ["role"], registry=r)
        self.actual = Gauge("pdserve_planner_actual_nodes", "active nodes per role", ["role"], registry=r)
        self.decided = Counter("pdserve_planner_decisions", "planner decisions by kind", ["kind"], registry=r)
        self.failed = Counter("pdserve_planner_action_failures", "planner actions that failed", registry=r)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # the planner must never take the router down
                log.exception("planner step failed")

    async def step(self) -> Decision:
        snapshot = self.snapshot()
        decision = self.planner.decide(snapshot)
        self.decisions.append(decision)
        self.decided.labels(decision.kind).inc()
        for role in ROLES:
            self.actual.labels(role).set(getattr(snapshot, f"{role}_nodes"))
            self.target.labels(role).set(getattr(decision, role))
        level = logging.INFO if decision.kind != "none" else logging.DEBUG
        log.log(level, "planner: %s -> %dP%dD%s (%s)", decision.kind, decision.prefill, decision.decode,
                f", one node becomes {decision.switch_to}" if decision.switch_to else "", "; ".join(decision.reasons))
        if decision.kind != "none":
            try:
                await self.act(decision)
            except ScaleError as exc:
                self.failed.inc()
                log.warning("planner: could not carry out %s: %s", decision.kind, exc)
        return decision

    def snapshot(self) -> PoolSnapshot:
        metrics, scaler = self.metrics, self.scaler
        now = {"ttft": bucket_counts(metrics.ttft), "itl": bucket_counts(metrics.itl)}
        ttft = interval_quantile(self._last["ttft"], now["ttft"], 0.9)
        itl = interval_quantile(self._last["itl"], now["itl"], 0.9)
        self._last = now
        tokens, t = _counter_value(metrics.prompt_tokens), time.monotonic()
        rate = (tokens - self._last_prompt_tokens) / max(t - self._last_time, 1e-6)
        self._last_prompt_tokens, self._last_time = tokens, t
        prefill, decode = scaler.active("prefill"), scaler.active("decode")
        per_token = [n.stats.get("prefill_ns_per_token", 0) / 1e9 for n in prefill if n.stats.get("prefill_ns_per_token")]
        total_blocks = sum(n.stats.get("total_blocks", 0) for n in decode)
        free_blocks = sum(n.stats.get("free_blocks", 0) for n in decode)
        return PoolSnapshot(len(prefill), len(decode), ttft, itl,
                            prefill_queue_tokens=sum(sum(n.queued_tokens.values()) for n in prefill),
                            prefill_s_per_token=sum(per_token) / len(per_token) if per_token else 0.0,
                            prefill_tokens_per_s=rate if prefill else 0.0,
                            decode_running=sum(n.stats.get("running", 0) for n in decode),
                            decode_waiting=sum(n.stats.get("waiting", 0) for n in decode),
                            decode_free_kv_fraction=free_blocks / total_blocks if total_blocks else 1.0)

    def recent(self, n: int = 10) -> list[dict]:
        """The last n decisions that did something, with their reasons (for GET /admin/nodes)."""
        acted = [d for d in self.decisions if d.kind != "none"][-n:]
        return [{"kind": d.kind, "prefill": d.prefill, "decode": d.decode, "switch_to": d.switch_to,
                 "reasons": d.reasons} for d in acted]

    async def act(self, decision: Decision) -> None:
        scaler = self.scaler
        if decision.kind == "switch":
            source = "decode" if decision.switch_to == "prefill" else "prefill"
            count = max(abs(getattr(decision, source) - len(scaler.active(source))), 1)
            candidates = sorted((n for n in scaler.active(source) if n.healthy),
                                key=lambda n: (len(n.requests), n.node_id))
            if not candidates:
                raise ScaleError(f"no healthy {source} node to switch")
            for node in candidates[:count]:  # the least busy ones: the fewest streams to move
                await scaler.switch(node.node_id, decision.switch_to)
        else:
            await scaler.scale({"prefill": decision.prefill, "decode": decision.decode})

