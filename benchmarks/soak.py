"""A fault soak: streaming clients against a 2P2D cluster (built-in model, NIXL handover) while
faults land at random moments (soak_faults), checked as it runs and at the end:

- every request the client kept completes, with the offline engine's text (greedy and seeded);
- no request waits past its deadline without an answer or an error;
- once traffic stops, every node's KV blocks in use, requests and the router's routed requests
  return to 0 (pinned NIXL blocks hold KV blocks, so they are counted there);
- each long-lived process's peak RSS stays within RSS_BOUND of its RSS after warm-up;
- no process started by the soak is left once it stops;
- the count of each fault, and the router's failover counters (its /health and /metrics).

    .venv/bin/python -m benchmarks.soak --minutes 10 --seed 1

Exit status 1 on any violation. tests/test_soak.py runs a short one.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.soak_cluster import SoakCluster
from benchmarks.soak_faults import Faults
from benchmarks.soak_load import Client, Tally, Workload

# A node's RSS grows for its first minutes of traffic (allocator arenas, NIXL and UCX pools,
# compiled kernels) to a plateau: the bound holds from WARM_S after a process starts (or a third
# of a shorter run), measured from its RSS then.
WARM_S = 120.0
RSS_SCALE, RSS_SLACK = 1.25, 64 << 20  # peak <= warm * RSS_SCALE + RSS_SLACK
RSS_BOUND = f"x{RSS_SCALE} + {RSS_SLACK >> 20} MiB"


class RssWatch:
    """Each process's RSS after its warm-up and its peak since, per pid (a restart starts anew)."""

    def __init__(self, cluster: SoakCluster, warm_s: float):
        self.cluster, self.warm_s = cluster, warm_s
        self.seen: dict[int, float] = {}
        self.warm: dict[int, tuple[str, int]] = {}
        self.peak: dict[int, int] = {}

    def sample(self) -> None:
        now = time.monotonic()
        for name, proc in self.cluster.procs.items():
            pid = proc.popen.pid if proc.popen else None
            rss = self.cluster.rss().get(name)
            if pid is None or rss is None:
                continue
            started = self.seen.setdefault(pid, now)
            if now - started >= self.warm_s:
                self.warm.setdefault(pid, (name, rss))
                self.peak[pid] = max(self.peak.get(pid, 0), rss)

    def violations(self) -> list[str]:
        return [f"{name} pid {pid}: {warm >> 20} MiB after warm-up, peak {self.peak[pid] >> 20} MiB"
                for pid, (name, warm) in self.warm.items() if self.peak[pid] > warm * RSS_SCALE + RSS_SLACK]

    def table(self) -> list[tuple[str, str]]:
        """Per process measured: its RSS after warm-up and its peak since, in MiB."""
        return [(f"RSS of {name} (pid {pid}), MiB", f"{warm >> 20} -> peak {self.peak[pid] >> 20}")
                for pid, (name, warm) in sorted(self.warm.items(), key=lambda kv: kv[1][0])]

    def growth(self) -> str:
        worst = max(((self.peak[p] - w) / w, n) for p, (n, w) in self.warm.items()) if self.warm else (0.0, "-")
        return f"{worst[0] * 100:+.1f}% ({worst[1]})"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="how long faults and traffic run")
    p.add_argument("--seed", type=int, default=1, help="the faults', moments' and clients' random seed")
    p.add_argument("--clients", type=int, default=4, help="concurrent streaming clients")
    p.add_argument("--abandon-rate", type=float, default=0.25, help="share of requests whose client leaves")
    p.add_argument("--deadline-s", type=float, default=150.0, help="a kept request's deadline, retries included")
    p.add_argument("--fault-gap-s", type=float, nargs=2, default=(4.0, 10.0), help="seconds between faults")
    p.add_argument("--lease-s", type=float, default=10.0, help="the nodes' NIXL lease")
    p.add_argument("--idle-s", type=float, default=None, help="traffic held back this long (default: lease + 2 s)")
    p.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    return p.parse_args(argv)


def run_traffic(args, cluster: SoakCluster, work: Workload, tally: Tally, watch: RssWatch) -> None:
    rng = random.Random(args.seed)
    stop, gate = threading.Event(), threading.Event()
    gate.set()
    faults = Faults(cluster, tally, random.Random(rng.random()), gate, args.idle_s or args.lease_s + 2)
    clients = [Client(cluster.url, work, tally, random.Random(rng.random()), args.deadline_s, args.abandon_rate,
                      gate, faults.on_first_token) for _ in range(args.clients)]
    threads = [threading.Thread(target=c.run, args=(stop,), daemon=True) for c in clients]
    threads.append(threading.Thread(target=faults.run, args=(stop, tuple(args.fault_gap_s)), daemon=True))
    for t in threads:
        t.start()
    end = time.monotonic() + args.minutes * 60
    while time.monotonic() < end:
        watch.sample()
        time.sleep(2)
    stop.set()
    gate.set()
    for t in threads:
        t.join(timeout=args.deadline_s + 10)
        if t.is_alive():
            tally.violate("hung", f"{t.name} still running {args.deadline_s:.0f} s after the soak ended")


def settle(cluster: SoakCluster, tally: Tally, lease_s: float) -> dict:
    """Every process back, then every count of held KV at 0; returns the router's /health."""
    if not cluster.wait_healthy(180):
        tally.violate("no recovery", "not every node healthy after the soak")
    deadline, body = time.monotonic() + lease_s + 30, None
    while time.monotonic() < deadline:
        body = cluster.health() or {}
        held = {n["id"]: (n.get("kv_blocks_in_use"), n.get("requests"), n.get("routed_requests"))
                for n in body.get("nodes", [])}
        if held and all(v == (0, 0, 0) for v in held.values()):
            return body
        time.sleep(1)
    tally.violate("held after the soak", f"(blocks, requests, routed) per node: {held}")
    return body or {}


def report(args, tally: Tally, watch: RssWatch, health: dict, left: list[str], seconds: float) -> dict:
    c = tally.counts
    rows = [("run", f"{seconds / 60:.1f} min, seed {args.seed}, {args.clients} clients"),
            ("requests sent", c["requests"]),
            ("completed, text identical (greedy / seeded)", f"{c['completed greedy']} / {c['completed seeded']}"),
            ("abandoned by their client", sum(v for k, v in c.items() if k.startswith("fault: client left"))),
            ("retried after an error (router down)", c["retries"]),
            ("lost", c["lost"]), ("text differs", c["text differs"]), ("hung", c["hung"]),
            ("blocks / requests held after", "0" if not c["held after the soak"] else "NOT 0"),
            (f"peak RSS growth after warm-up (bound {RSS_BOUND})", watch.growth()),
            ("processes left behind", len(left))]
    rows += watch.table()
    rows += [(k, v) for k, v in sorted(c.items()) if k.startswith("fault: ")]
    rows += [(f"router: {k}", v) for k, v in sorted(health.get("failover", {}).items())]
    print("\n| what | count |\n|---|---|")
    for what, value in rows:
        print(f"| {what} | {value} |")
    for v in tally.violations:
        print("VIOLATION", v)
    return {"rows": rows, "violations": tally.violations, "counts": dict(c)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work, tally = Workload(), Tally()
    with tempfile.TemporaryDirectory(prefix="pdserve-soak-") as tmp:
        cluster = SoakCluster(Path(tmp), args.lease_s)
        watch = RssWatch(cluster, min(WARM_S, args.minutes * 20))
        started, health, left = time.monotonic(), {}, []
        try:
            cluster.start()
            run_traffic(args, cluster, work, tally, watch)
            health = settle(cluster, tally, args.lease_s)
        finally:
            left = cluster.stop()
        for line in watch.violations():
            tally.violate("RSS", line)
        for proc in left:
            tally.violate("left behind", proc)
        result = report(args, tally, watch, health, left, time.monotonic() - started)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1, default=str))
    return 1 if tally.violations else 0


if __name__ == "__main__":
    sys.exit(main())
