"""The soak's faults, injected at random moments, each kind in turn (shuffled every round) so
that their counts stay even: SIGKILL of a prefill node, a decode node or the router (restarted on
the same addresses by the cluster's supervisor); SIGSTOP then SIGCONT of a node or the router (a
process that hangs, then wakes); a prefill node killed right after a first token, while the
decode node pulls its blocks; traffic held back past every idle timer (the NIXL lease, the
router's HTTP keep-alive, the clients' own), then resumed; a decode node drained under load
(switched to prefill through the router's /admin/switch, its streams moved to the other decode
node) and switched back a moment later; with a TP 2 decode-0, SIGKILL of its worker process
(the node goes down with it and is restarted); the decode pool scaled up by one node (the
cluster, as the router's node owner, starts it) and down again, removing that node while an
operator's role switch drains the same node (the switch waits for the scale, then must answer
that the node is gone, at once); and on a store cluster, SIGKILL of Redis (restarted
empty: what it held is recomputed) and SIGSTOP then SIGCONT of Redis. Client disconnects at each
stage are the clients' own (soak_load)."""
from __future__ import annotations

import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from benchmarks.soak_cluster import SoakCluster
from benchmarks.soak_load import Gate, Tally

FAULTS = ("kill prefill", "kill decode", "stop node", "kill router", "stop router", "idle",
          "prefill restart during pull", "drain decode", "drain during scale")
STORE_FAULTS = ("kill redis", "stop redis")
ALL_KINDS = (*FAULTS, "kill tp worker", *STORE_FAULTS)
SCALE_TIMEOUT_S = 360.0  # a scale up waits for the new node to load and join
SWITCH_AFTER_SCALE_S = 10.0  # a switch that waited for a scale answers at most this long after it
RECOVERY_S = 120.0  # every process back and healthy within this, or the soak counts a violation
REDIS_STOP_S = (2.0, 5.0)  # a few seconds: the nodes' calls to Redis wait (their socket timeout is 5 s)


def kinds(cluster: SoakCluster) -> tuple[str, ...]:
    return tuple(k for k in ALL_KINDS if (k != "kill tp worker" or cluster.decode_tp > 1)
                 and (k not in STORE_FAULTS or cluster.redis is not None))


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
            self.cluster.signal(self._target(kind), signal.SIGKILL)
        elif kind in ("stop node", "stop router", "stop redis"):
            name = self.rng.choice(self.cluster.nodes) if kind == "stop node" else self._target(kind)
            self.cluster.signal(name, signal.SIGSTOP)
            # a node or the router: past 1.5 s the router counts a node dead
            time.sleep(self.rng.uniform(*REDIS_STOP_S) if kind == "stop redis" else self.rng.uniform(0.5, 3.0))
            self.cluster.signal(name, signal.SIGCONT)
        elif kind == "idle" and not self.idle(stop):
            return  # the soak ended during the pause: no request after it to count
        elif kind == "drain decode" and not self.drain(self._node("decode")):
            return
        elif kind == "kill tp worker" and not self.cluster.kill_worker("decode-0"):
            return
        elif kind == "drain during scale" and not self.drain_during_scale():
            return
        self.tally.add(f"fault: {kind}")

    def _target(self, kind: str) -> str:
        """The process a kill or stop of the router or Redis hits (a Redis Cluster: a master)."""
        return self.cluster.redis.target(self.rng) if kind.endswith("redis") else "router"

    def idle(self, stop: threading.Event) -> bool:
        """No request at all for idle_s, timed from the last one's end; then each client's next
        request must succeed at once (soak_load.Client), and the next fault waits for them."""
        if not self.gate.close(self.deadline_s):
            self.tally.violate("hung", f"requests still running {self.deadline_s:.0f} s after traffic stopped")
        ended_in_pause = stop.wait(self.idle_s)
        self.gate.reopen()
        if ended_in_pause:
            return False
        deadline = time.monotonic() + self.deadline_s
        while not self.gate.wait_after_pause(0.5):  # in steps: clients leave at the soak's end without one
            if stop.is_set():
                return True  # the pause landed; the soak ended before every client's next request did
            if time.monotonic() > deadline:
                self.tally.violate("hung", f"first requests after an idle pause not done in {self.deadline_s:.0f} s")
                break
        return True

    def _admin(self, path: str, body: dict) -> httpx.Response | None:
        """POST to the router's admin route; None, with a violation, on no answer or a 5xx."""
        try:
            reply = httpx.post(f"{self.cluster.url}{path}", json=body, timeout=SCALE_TIMEOUT_S)
        except httpx.HTTPError as exc:
            self.tally.violate("scale failed", f"{path} {body}: {type(exc).__name__}: {exc}")
            return None
        if reply.status_code >= 500:
            self.tally.violate("scale failed", f"{path} {body}: {reply.status_code} {reply.text}")
            return None
        return reply

    def drain_during_scale(self) -> bool:
        """One decode node more (it joins under load), then back to two, removing it, while a
        switch drains it: the scale answers 200; the switch 400 'no node' no later than a few
        seconds after the scale (it waited for it), or 200 when it came first (the node is then
        removed as a prefill node)."""
        up = self._admin("/admin/scale", {"decode": 3})
        if up is None or up.status_code != 200 or len(added := up.json()["added"]) != 1:
            if up is not None:
                self.tally.violate("scale failed", f"scaling up: {up.status_code} {up.text}")
            return False
        with ThreadPoolExecutor(1) as pool:
            down = pool.submit(self._timed_admin, "/admin/scale", {"decode": 2, "remove": added})
            time.sleep(self.rng.uniform(0.0, 1.0))
            switch, switch_at = self._timed_admin("/admin/switch", {"node_id": added[0], "to_role": "prefill"})
            (down, down_at) = down.result()
        if switch is not None and switch.status_code != 200 and (
                "no node" not in switch.text or switch_at - down_at > SWITCH_AFTER_SCALE_S):
            self.tally.violate("scale failed", f"the switch during the scale: {switch.status_code} {switch.text}, "
                               f"{switch_at - down_at:.1f} s after the scale")
        first = switch is not None and switch.status_code == 200
        self.tally.add("switch during scale: came first" if first else "switch during scale: waited for it")
        if added[0] in self.cluster.owned_nodes():  # switched first: still running, as a prefill node
            down = self._admin("/admin/scale", {"prefill": 2, "decode": 2, "remove": added})
        if down is None or down.status_code != 200 or added[0] in self.cluster.owned_nodes():
            if down is not None:
                self.tally.violate("scale failed", f"scaling down: {down.status_code} {down.text[:300]}")
            return False
        return True

    def _timed_admin(self, path: str, body: dict) -> tuple[httpx.Response | None, float]:
        reply = self._admin(path, body)
        return reply, time.monotonic()

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
