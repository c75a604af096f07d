"""The soak's faults, injected at random moments, each kind in turn (shuffled every round) so
that their counts stay even: SIGKILL of a prefill node, a decode node or the router (restarted on
the same addresses by the cluster's supervisor); SIGSTOP then SIGCONT of a node or the router (a
process that hangs, then wakes); a prefill node killed right after a first token, while the
decode node pulls its blocks; and traffic held back past the NIXL lease, then resumed. Client
disconnects at each stage are the clients' own (soak_load)."""
from __future__ import annotations

import random
import signal
import threading
import time

from benchmarks.soak_cluster import SoakCluster
from benchmarks.soak_load import Tally

FAULTS = ("kill prefill", "kill decode", "stop node", "kill router", "stop router", "idle",
          "prefill restart during pull")
RECOVERY_S = 120.0  # every process back and healthy within this, or the soak counts a violation


class Faults:
    def __init__(self, cluster: SoakCluster, tally: Tally, rng: random.Random, gate: threading.Event,
                 idle_s: float):
        self.cluster, self.tally, self.rng, self.gate, self.idle_s = cluster, tally, rng, gate, idle_s
        self._kill_at_first_token = threading.Event()

    def on_first_token(self) -> None:
        """A client got a first token: its handover is on its way, the decode node about to pull."""
        if self._kill_at_first_token.is_set():
            self._kill_at_first_token.clear()
            self.cluster.signal(self._node("prefill"), signal.SIGKILL)
            self.tally.add("fault: prefill restart during pull")

    def run(self, stop: threading.Event, gap_s: tuple[float, float]) -> None:
        order: list[str] = []
        while not stop.wait(self.rng.uniform(*gap_s)):
            if not self.cluster.wait_healthy(RECOVERY_S):
                self.tally.violate("no recovery", f"not every process healthy {RECOVERY_S:.0f} s after a fault")
                continue
            if not order:
                order = list(FAULTS)
                self.rng.shuffle(order)
            self.inject(order.pop(), stop)

    def _node(self, role: str) -> str:
        return self.rng.choice([n for n in self.cluster.nodes if n.startswith(role)])

    def inject(self, kind: str, stop: threading.Event) -> None:
        if kind == "prefill restart during pull":
            self._kill_at_first_token.set()  # counted when a first token triggers it
            return
        if kind in ("kill prefill", "kill decode"):
            self.cluster.signal(self._node(kind.split()[1]), signal.SIGKILL)
        elif kind == "kill router":
            self.cluster.signal("router", signal.SIGKILL)
        elif kind in ("stop node", "stop router"):
            name = "router" if kind == "stop router" else self.rng.choice(self.cluster.nodes)
            self.cluster.signal(name, signal.SIGSTOP)
            time.sleep(self.rng.uniform(0.5, 3.0))  # past 1.5 s the router counts a node dead
            self.cluster.signal(name, signal.SIGCONT)
        elif kind == "idle":
            self.gate.clear()
            stop.wait(self.idle_s)
            self.gate.set()
        self.tally.add(f"fault: {kind}")
