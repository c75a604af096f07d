"""The routers of `pdserve up --ray`: router i on port + i, spread over the machines.

Router i is pinned (hard node affinity) to one machine, round robin over the live machines that
have CPUs: SPREAD packs zero-CPU actors onto one machine, and soft affinity was not honoured
(Ray 2.60 placed a soft-pinned router on the head). Ray restarts a router whose process died on
its machine; a router whose machine is gone cannot come back there, so a watch thread starts it
again on another live machine once it has been unreachable for REPLACE_AFTER_S.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)
WATCH_S = 2.0
REPLACE_AFTER_S = 15.0


def cpu_machines() -> list[str]:
    """Node ids of the live machines, those with CPUs first choice, in a stable order."""
    import ray  # optional dependency: ray (the pdserve[ray] extra)
    alive = [n for n in ray.nodes() if n["Alive"]]
    with_cpus = sorted(n["NodeID"] for n in alive if n["Resources"].get("CPU", 0) > 0)
    return with_cpus or sorted(n["NodeID"] for n in alive)


class RayRouters:
    def __init__(self, make_actor: Callable[[str, list[str], object], object], template: list[str], port: int):
        """make_actor(name, template, scheduling_strategy) -> a ProcessActor handle."""
        self.make_actor = make_actor
        self.template = template
        self.port = port
        self.actors: list[object] = []
        self.machines: list[str] = []  # router i's machine
        self.replaced = 0
        self._down_since: dict[int, float] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="router-watch", daemon=True)

    def start(self, count: int) -> list[str]:
        import ray  # optional dependency: ray (the pdserve[ray] extra)
        machines = cpu_machines()
        for i in range(count):
            self._place(i, machines[i % len(machines)])
        infos = ray.get([a.info.remote() for a in self.actors])
        self._thread.start()
        return [f"http://{info['ip']}:{self.port + i}" for i, info in enumerate(infos)]

    def _place(self, i: int, machine: str) -> None:
        # optional dependency: ray (the pdserve[ray] extra)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        template = [arg.replace("{router_port}", str(self.port + i)) for arg in self.template]
        actor = self.make_actor(f"router-{i}", template, NodeAffinitySchedulingStrategy(machine, soft=False))
        with self._lock:
            if i < len(self.actors):
                self.actors[i], self.machines[i] = actor, machine
            else:
                self.actors.append(actor)
                self.machines.append(machine)

    def _watch(self) -> None:
        import ray  # optional dependency: ray (the pdserve[ray] extra)
        while not self._stop.wait(WATCH_S):
            for i, actor in enumerate(list(self.actors)):
                try:
                    ray.get(actor.alive.remote(), timeout=10)
                    self._down_since.pop(i, None)
                except Exception:  # restarting, or its machine is gone
                    since = self._down_since.setdefault(i, time.monotonic())
                    if time.monotonic() - since >= REPLACE_AFTER_S and not self._stop.is_set():
                        self._replace(i, actor)

    def _replace(self, i: int, actor) -> None:
        import ray  # optional dependency: ray (the pdserve[ray] extra)
        live = cpu_machines()
        if not live:
            return
        used = set(self.machines)
        machine = next((m for m in live if m not in used), live[i % len(live)])
        log.warning("router-%d has been unreachable for %.0f s: starting it on another machine", i, REPLACE_AFTER_S)
        try:
            ray.kill(actor, no_restart=True)
        except Exception as exc:  # already gone with its machine
            log.info("router-%d: %s", i, exc)
        self._place(i, machine)
        self._down_since.pop(i, None)
        self.replaced += 1

    def stop(self, stop_actors: Callable[[list], None]) -> None:
        self._stop.set()
        self._thread.join(timeout=15)
        with self._lock:
            actors, self.actors = self.actors, []
        stop_actors(actors)
