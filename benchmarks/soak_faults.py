"""The soak's faults, injected at random moments, each kind in turn (shuffled every round) so
that their counts stay even: SIGKILL of a prefill node, a decode node or the router (restarted on
the same addresses by the cluster's supervisor); SIGSTOP then SIGCONT of a node or the router (a
process that hangs, then wakes); a prefill node killed right after a first token, while the
decode node pulls its blocks; traffic held back past every idle timer (the NIXL lease, the
router's HTTP keep-alive, the clients' own), then resumed; a decode node drained under load
(switched to prefill through the router's /admin/switch, its streams moved to the other decode
node) and switched back a moment later; with a TP 2 decode-0, SIGKILL of its worker process
(the node goes down with it and is restarted); and on a store cluster, SIGKILL of Redis (restarted
empty: what it held is recomputed) and SIGSTOP then SIGCONT of Redis. Client disconnects at each
stage are the clients' own (soak_load)."""
from __future__ import annotations

import random
import signal
import threading
import time

import httpx

from benchmarks.soak_cluster import SoakCluster
from benchmarks.soak_load import Gate, Tally

FAULTS = ("kill prefill", "kill decode", "stop node", "kill router", "stop router", "idle",
          "prefill restart during pull", "drain decode")
STORE_FAULTS = ("kill redis", "stop redis")
ALL_KINDS = (*FAULTS, "kill tp worker", *STORE_FAULTS)
RECOVERY_S = 120.0  # every process back and healthy within this, or the soak counts a violation
REDIS_STOP_S = (2.0, 5.0)  # a few seconds: the nodes' calls to Redis wait (their socket timeout is 5 s)


def kinds(cluster: SoakCluster) -> tuple[str, ...]:
    return tuple(k for k in ALL_KINDS if (k != "kill tp worker" or cluster.decode_tp > 1)
                 and (k not in STORE_FAULTS or cluster.redis_port is not None))


class Faults:
    def __init__(self, cluster: SoakCluster, tally: Tally, rng: random.Random, gate: Gate, idle_s: float,
                 lead: tuple[str, ...] = (), deadline_s: float = 150.0):
        self.cluster, self.tally, self.rng, self.gate, self.idle_s = cluster, tally, rng, gate, idle_s
        self.kinds = kinds(cluster)
        self.lead = [k for k in lead if k in self.kinds]  # these land first, in this order
        self.deadline_s = deadline_s
        self._kill_at_first_token = threading.Event()

    def on_first_token(self) -> None:
        """A client got a first token: its handover is on its way, the decode node about to pull."""
        if self._kill_at_first_token.is_set():
            self._kill_at_first_token.clear()
            self.cluster.signal(self._node("prefill"), signal.SIGKILL)
            self.tally.add("fault: prefill restart during pull")

    def run(self, stop: threading.Event, gap_s: tuple[float, float]) -> None:
        order: list[str] = list(reversed(self.lead))
        while not stop.wait(self.rng.uniform(*gap_s)):
            if not self.recovered(stop):
                continue
            if not order:
                order = list(self.kinds)
                self.rng.shuffle(order)
            self.inject(order.pop(), stop)

    def recovered(self, stop: threading.Event) -> bool:
        """Every process healthy again (the slowest recovery is reported); False at the soak's end."""
        started = time.monotonic()
        while not self.cluster.all_healthy():
            if stop.wait(0.5):
                return False  # settle() waits for the rest
            if time.monotonic() - started > RECOVERY_S:
                self.tally.violate("no recovery", f"not every process healthy {RECOVERY_S:.0f} s after a fault")
                return False
        self.tally.recovery(time.monotonic() - started)
        return True

    def _node(self, role: str) -> str:
        return self.rng.choice([n for n in self.cluster.nodes if n.startswith(role)])

    def inject(self, kind: str, stop: threading.Event) -> None:
        if kind == "prefill restart during pull":
            self._kill_at_first_token.set()  # counted when a first token triggers it
            return
        if kind in ("kill prefill", "kill decode"):
            self.cluster.signal(self._node(kind.split()[1]), signal.SIGKILL)
        elif kind in ("kill router", "kill redis"):
            self.cluster.signal(kind.split()[1], signal.SIGKILL)
        elif kind in ("stop node", "stop router", "stop redis"):
            name = self.rng.choice(self.cluster.nodes) if kind == "stop node" else kind.split()[1]
            self.cluster.signal(name, signal.SIGSTOP)
            # a node or the router: past 1.5 s the router counts a node dead
            time.sleep(self.rng.uniform(*REDIS_STOP_S) if name == "redis" else self.rng.uniform(0.5, 3.0))
            self.cluster.signal(name, signal.SIGCONT)
        elif kind == "idle" and not self.idle(stop):
            return  # the soak ended during the pause: no request after it to count
        elif kind == "drain decode" and not self.drain(self._node("decode")):
            return
        elif kind == "kill tp worker" and not self.cluster.kill_worker("decode-0"):
            return
        self.tally.add(f"fault: {kind}")

    def idle(self, stop: threading.Event) -> bool:
        """No request at all for idle_s, timed from the last one's end; then each client's next
        request must succeed at once (soak_load.Client), and the next fault waits for them."""
        if not self.gate.close(self.deadline_s):
            self.tally.violate("hung", f"requests still running {self.deadline_s:.0f} s after traffic stopped")
        stop.wait(self.idle_s)
        self.gate.reopen()
        deadline = time.monotonic() + self.deadline_s
        while not self.gate.wait_after_pause(0.5):  # in steps: clients leave at the soak's end without one
            if stop.is_set():
                return False
            if time.monotonic() > deadline:
                self.tally.violate("hung", f"first requests after an idle pause not done in {self.deadline_s:.0f} s")
                break
        return True

    def drain(self, node: str) -> bool:
        """Switch a decode node to prefill (it drains: its streams move on) and back; False, with
        a violation, when the router refuses either switch."""
        for role in ("prefill", "decode"):
            try:
                reply = httpx.post(f"{self.cluster.url}/admin/switch", json={"node_id": node, "to_role": role},
                                   timeout=self.deadline_s)
            except httpx.HTTPError as exc:
                self.tally.violate("drain failed", f"switching {node} to {role}: {type(exc).__name__}: {exc}")
                return False
            if reply.status_code != 200:
                self.tally.violate("drain failed", f"switching {node} to {role}: {reply.status_code} {reply.text}")
                return False
            time.sleep(self.rng.uniform(0.5, 2.0))
        return True
