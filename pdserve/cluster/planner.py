"""The SLA planner's decisions: from what the routers measured over one interval, how many prefill
and decode nodes the cluster should run, and the cheapest way to get there.

Pure logic (no sockets, no clock): `SlaPlanner.decide(snapshot)` takes a `PoolSnapshot` and
returns a `Decision`; the router's planner loop (pdserve/router/scaling/planner_loop.py) builds the
snapshots and carries decisions out. The simulator can drive the same object.

The rules, per role:
  * pressure = the measured latency over its SLO: TTFT p90 for prefill, ITL p90 for decode. A
    prefill queue longer than the pool clears within the TTFT SLO (at the nodes' measured
    seconds per token) counts as pressure too, and so does a decode pool short of free KV blocks;
  * pressure above 1 (the SLO missed) asks for more nodes of that role, in proportion (at most
    MAX_STEP per interval); a pool under LOW_PRESSURE for `calm_intervals` in a row, or with no
    traffic, has a node to spare;
  * nodes move between roles by switches when one role needs nodes and the other can spare them
    (a switch costs a drain and well under a second; a new node costs a process start and a
    weight load), else the total grows within max_nodes, or shrinks within min_nodes;
  * after any action the planner waits `cooldown_intervals` before acting again (hysteresis: the
    pools must settle before their latencies say anything new).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

LOW_PRESSURE = 0.5  # below this fraction of its SLO, a pool could lose a node
TARGET_PRESSURE = 0.7  # a pool giving nodes away keeps enough to stay at this fraction of its SLO
TARGET_UTILIZATION = 0.7  # prefill work per prefill node, as a share of its time
MAX_STEP = 2  # nodes added to a role per decision
DEFAULT_TTFT_SLO_MS = 1000.0  # the planner's targets when the operator sets none
DEFAULT_ITL_SLO_MS = 100.0
KV_LOW_FREE = 0.05  # decode nodes with less than this fraction of their KV blocks free are full


@dataclass
class PoolSnapshot:
    """What the routers measured over one interval."""
    prefill_nodes: int
    decode_nodes: int
    ttft_p90_s: float | None = None     # None: no request got its first token this interval
    itl_p90_s: float | None = None      # None: no decode step this interval
    prefill_queue_tokens: int = 0       # prompt tokens waiting at prefill nodes
    prefill_s_per_token: float = 0.0    # the prefill nodes' measured cost (0: not yet measured)
    prefill_tokens_per_s: float = 0.0   # prompt tokens arriving per second
    decode_running: int = 0             # requests in the decode nodes' batches
    decode_waiting: int = 0             # requests queued at decode nodes for a batch slot
    decode_free_kv_fraction: float = 1.0


@dataclass
class PlannerConfig:
    ttft_slo_s: float
    itl_slo_s: float
    min_nodes: int = 2
    max_nodes: int = 8
    min_prefill: int = 1
    min_decode: int = 1
    calm_intervals: int = 3
    cooldown_intervals: int = 2
    max_step: int = MAX_STEP  # nodes a role may gain in one decision


@dataclass
class Decision:
    kind: str                           # "none" | "scale" | "switch"
    prefill: int                        # target counts
    decode: int
    switch_to: str | None = None        # "switch": the role one node of the other role becomes
    reasons: list[str] = field(default_factory=list)


class SlaPlanner:
    def __init__(self, config: PlannerConfig):
        if config.min_nodes > config.max_nodes:
            raise ValueError(f"--min-nodes {config.min_nodes} exceeds --max-nodes {config.max_nodes}")
        if config.min_decode < 1 or config.min_prefill < 0:
            raise ValueError("the planner needs --min-decode-nodes >= 1 and --min-prefill-nodes >= 0")
        if config.min_prefill + config.min_decode > config.max_nodes:
            raise ValueError(f"--max-nodes {config.max_nodes} leaves no room for one node of each role")
        self.config = config
        self.calm = {"prefill": 0, "decode": 0}  # consecutive intervals each pool was under LOW_PRESSURE
        self.cooldown = 0

    # ---- pressure -----------------------------------------------------------------------
    def pressures(self, s: PoolSnapshot) -> tuple[dict[str, float], list[str]]:
        c, reasons = self.config, []
        prefill = (s.ttft_p90_s or 0.0) / c.ttft_slo_s
        if s.ttft_p90_s is not None:
            reasons.append(f"TTFT p90 {s.ttft_p90_s * 1e3:.0f} ms vs SLO {c.ttft_slo_s * 1e3:.0f} ms")
        if s.prefill_queue_tokens and s.prefill_s_per_token > 0 and s.prefill_nodes > 0:
            drain_s = s.prefill_queue_tokens * s.prefill_s_per_token / s.prefill_nodes
            if drain_s / c.ttft_slo_s > prefill:
                reasons.append(f"prefill queue of {s.prefill_queue_tokens} tokens needs {drain_s * 1e3:.0f} ms")
                prefill = drain_s / c.ttft_slo_s
        if s.prefill_tokens_per_s and s.prefill_s_per_token > 0:
            # Prefill work arriving, in node-seconds per second: past TARGET_UTILIZATION per node
            # queues build up before any TTFT shows it.
            busy = s.prefill_tokens_per_s * s.prefill_s_per_token / max(s.prefill_nodes, 1) / TARGET_UTILIZATION
            if busy > prefill:
                reasons.append(f"prefill nodes {busy * TARGET_UTILIZATION:.0%} busy")
                prefill = busy
        decode = (s.itl_p90_s or 0.0) / c.itl_slo_s
        if s.itl_p90_s is not None:
            reasons.append(f"ITL p90 {s.itl_p90_s * 1e3:.1f} ms vs SLO {c.itl_slo_s * 1e3:.1f} ms")
        if s.decode_free_kv_fraction < KV_LOW_FREE and decode <= 1.0:
            reasons.append(f"decode KV {s.decode_free_kv_fraction:.0%} free")
            decode = 1.01
        if s.decode_waiting:  # requests that found no batch slot: their next token is late already
            queued = 1.0 + s.decode_waiting / max(s.decode_running, 1)
            if queued > decode:
                reasons.append(f"{s.decode_waiting} requests wait for a decode slot")
                decode = queued
        return {"prefill": prefill, "decode": decode}, reasons

    # ---- decide -------------------------------------------------------------------------
    def decide(self, s: PoolSnapshot) -> Decision:
        pressure, reasons = self.pressures(s)
        have = {"prefill": s.prefill_nodes, "decode": s.decode_nodes}
        for role in have:
            self.calm[role] = self.calm[role] + 1 if pressure[role] < LOW_PRESSURE else 0
        if self.cooldown > 0:
            self.cooldown -= 1
            return Decision("none", have["prefill"], have["decode"], reasons=reasons + ["cooling down"])
        decision = self._plan(have, pressure, reasons)
        if decision.kind != "none":
            self.cooldown = self.config.cooldown_intervals
            self.calm = {"prefill": 0, "decode": 0}
        return decision

    def _needs(self, have: dict[str, int], pressure: dict[str, float]) -> dict[str, int]:
        """Nodes each role wants added: in proportion to how far past its SLO it is."""
        step = self.config.max_step
        return {role: min(step, max(1, math.ceil(max(have[role], 1) * pressure[role]) - have[role]))
                if pressure[role] > 1.0 else 0 for role in have}

    def _spare(self, role: str, have: dict[str, int], pressure: dict[str, float]) -> int:
        """Nodes a pool calm for calm_intervals can give up and stay under TARGET_PRESSURE (its
        latency taken as proportional to its load per node)."""
        if self.calm[role] < self.config.calm_intervals:
            return 0
        floor = self.config.min_prefill if role == "prefill" else self.config.min_decode
        keep = max(floor, math.ceil(have[role] * pressure[role] / TARGET_PRESSURE))
        return max(have[role] - keep, 0)

    def _plan(self, have: dict[str, int], pressure: dict[str, float], reasons: list[str]) -> Decision:
        c = self.config
        total = have["prefill"] + have["decode"]
        need = self._needs(have, pressure)
        target = dict(have)
        # The neediest role first: the one furthest past its SLO.
        for role in sorted(need, key=lambda r: -pressure[r]):
            if not need[role]:
                continue
            other = "decode" if role == "prefill" else "prefill"
            moved = min(need[role], self._spare(other, have, pressure)) if need[other] == 0 else 0
            if moved:
                target[role] += moved
                target[other] -= moved
                return Decision("switch", target["prefill"], target["decode"], role,
                                reasons + [f"{role} over its SLO ({pressure[role]:.2f}x), {other} calm: "
                                           f"switch {moved}"])
            room = c.max_nodes - total
            if room > 0:
                target[role] += min(need[role], room)
                return Decision("scale", target["prefill"], target["decode"],
                                reasons=reasons + [f"{role} over its SLO ({pressure[role]:.2f}x): "
                                                   f"+{target[role] - have[role]}"])
            reasons = reasons + [f"{role} over its SLO ({pressure[role]:.2f}x) but at --max-nodes {c.max_nodes}"]
        if total < c.min_nodes:  # below the floor (e.g. a node left): grow the busier role
            role = max(have, key=lambda r: (pressure[r], r == "decode"))
            target[role] += c.min_nodes - total
            return Decision("scale", target["prefill"], target["decode"],
                            reasons=reasons + [f"{total} nodes is under --min-nodes {c.min_nodes}"])
        if not any(need.values()) and total > c.min_nodes:
            for role, other in (("prefill", "decode"), ("decode", "prefill")):
                if pressure[other] > TARGET_PRESSURE:  # keep it: the other pool may want it by switch soon
                    continue
                spare = min(self._spare(role, have, pressure), total - c.min_nodes, c.max_step)
                if spare:
                    target[role] -= spare
                    return Decision("scale", target["prefill"], target["decode"],
                                    reasons=reasons + [f"{role} under {LOW_PRESSURE:.0%} of its SLO for "
                                                       f"{self.calm[role]} intervals: -{spare}"])
        return Decision("none", have["prefill"], have["decode"], reasons=reasons)


def add_planner_args(p) -> None:
    p.add_argument("--planner", choices=["none", "sla"], default="none",
                   help="sla: resize the pools and switch roles to hold the TTFT/ITL targets")
    p.add_argument("--ttft-slo-ms", type=float, default=None,
                   help="the TTFT target (p90) of the planner and of --prefill-placement slo, for requests that "
                        f"set none (unset: no target; the planner then uses {DEFAULT_TTFT_SLO_MS:.0f})")
    p.add_argument("--itl-slo-ms", type=float, default=None,
                   help="the inter-token latency target (p90) of the planner and of --prefill-placement slo, "
                        "for requests that set none; decode nodes cap their prefill chunks to hold it (unset: "
                        f"no target, no cap; the planner then uses {DEFAULT_ITL_SLO_MS:.0f})")
    p.add_argument("--min-nodes", type=int, default=2, help="the planner keeps at least this many nodes")
    p.add_argument("--max-nodes", type=int, default=8, help="... and at most this many")
    p.add_argument("--min-prefill-nodes", type=int, default=1,
                   help="the planner keeps at least this many prefill nodes (0: it may go monolithic)")
    p.add_argument("--min-decode-nodes", type=int, default=1, help="... and decode nodes")
    p.add_argument("--planner-interval-s", type=float, default=5.0, help="seconds between decisions")


def planner_targets_ms(args) -> tuple[float, float]:
    """The SLA planner's TTFT and ITL targets: the operator's, else the defaults."""
    ttft, itl = getattr(args, "ttft_slo_ms", None), getattr(args, "itl_slo_ms", None)
    return (DEFAULT_TTFT_SLO_MS if ttft is None else ttft, DEFAULT_ITL_SLO_MS if itl is None else itl)


def target_flags(args) -> list[str]:
    """--ttft-slo-ms/--itl-slo-ms as the operator set them (none when unset)."""
    flags = []
    for flag, value in (("--ttft-slo-ms", getattr(args, "ttft_slo_ms", None)),
                        ("--itl-slo-ms", getattr(args, "itl_slo_ms", None))):
        if value is not None:
            flags += [flag, str(value)]
    return flags


def placement_flags(args) -> list[str]:
    """--prefill-placement, --handover and, when the planner does not pass them already, the targets."""
    flags = ["--prefill-placement", getattr(args, "prefill_placement", "threshold"),
             "--handover", getattr(args, "handover", "pull")]
    if getattr(args, "planner", "none") != "sla":
        flags += target_flags(args)
    return flags


def planner_flags(args) -> list[str]:
    """The planner flags as `pdserve up` passes them on to its router."""
    if getattr(args, "planner", "none") != "sla":
        return []
    return ["--planner", "sla", *target_flags(args),
            "--min-nodes", str(args.min_nodes), "--max-nodes", str(args.max_nodes),
            "--min-prefill-nodes", str(args.min_prefill_nodes), "--min-decode-nodes", str(args.min_decode_nodes),
            "--planner-interval-s", str(args.planner_interval_s)]

