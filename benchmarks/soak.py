"""A fault soak: streaming clients against a 2P2D cluster (built-in model) for each KV transport
(NIXL, the store over Redis through LMCache, through pdserve's direct Redis client, or through
its Redis Cluster client to 3 masters with a replica each; with
`--transport both`, NIXL and LMCache's store side by side, each with its own clients and
faults) while faults land at random moments (soak_faults), checked as it runs and at the end:

- every request the client kept completes, with the offline engine's text (greedy, seeded, under
  a LoRA adapter and under a regular expression; one decode node speculates, the offline engine
  does not);
- no request waits past its deadline without an answer or an error;
- each client's first request after an idle pause (past every keep-alive and lease) succeeds at
  its first attempt;
- once traffic stops, every node's KV blocks in use, requests and the router's routed requests
  return to 0 (pinned NIXL blocks hold KV blocks, so they are counted there);
- each long-lived process's peak RSS, the router's included, stays within RSS_BOUND of its RSS
  after warm-up;
- no process started by the soak is left once it stops;
- the count of each fault, and the router's failover counters (its /health and /metrics).

    .venv/bin/python -m benchmarks.soak --minutes 10 --seed 1 --transport both

Exit status 1 on any violation. tests/test_soak.py
runs a short one.
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

from benchmarks.soak_cluster import KEEP_ALIVE_S, TRANSPORTS, SoakCluster
from benchmarks.soak_faults import ALL_KINDS, Faults
from benchmarks.soak_load import Client, Gate, Tally, Workload, make_soak_adapter
from benchmarks.soak_report import DraftCount, RssWatch, report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="how long faults and traffic run")
    p.add_argument("--transport", choices=[*TRANSPORTS, "both"], default="both",
                   help="the KV transport of the soaked cluster (direct-store: direct+redis://; cluster-store: "
                        "redis-cluster://, a Redis Cluster whose masters the Redis faults hit); both: nixl "
                        "and store, one cluster each, soaked side by side")
    p.add_argument("--seed", type=int, default=1, help="the faults', moments' and clients' random seed")
    p.add_argument("--clients", type=int, default=4, help="concurrent streaming clients")
    p.add_argument("--abandon-rate", type=float, default=0.25, help="share of requests whose client leaves")
    p.add_argument("--deadline-s", type=float, default=150.0, help="a kept request's deadline, retries included")
    p.add_argument("--fault-gap-s", type=float, nargs=2, default=(4.0, 10.0), help="seconds between faults")
    p.add_argument("--lead", default="", help="fault kinds that land first, in this order (comma-separated; "
                   f"kinds: {', '.join(ALL_KINDS)}); the others follow, shuffled")
    p.add_argument("--decode-tp", type=int, default=1, choices=(1, 2),
                   help="decode-0's tensor-parallel degree; 2 adds the fault 'kill tp worker'")
    p.add_argument("--lease-s", type=float, default=10.0, help="the nodes' NIXL lease")
    p.add_argument("--idle-s", type=float, default=None,
                   help=f"traffic held back this long (default: the longer of the lease and the router's "
                        f"{KEEP_ALIVE_S:.0f} s keep-alive, plus 2 s)")
    p.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    p.add_argument("--logs", type=Path, default=None, help="keep every process's log here (default: discarded)")
    args = p.parse_args(argv)
    args.transports = ["nixl", "store"] if args.transport == "both" else [args.transport]
    args.idle_s = args.idle_s or max(args.lease_s, KEEP_ALIVE_S) + 2
    unknown = [k for k in filter(None, args.lead.split(",")) if k not in ALL_KINDS]
    if unknown:
        p.error(f"--lead: unknown fault kinds {unknown}")
    return args


def run_traffic(args, cluster: SoakCluster, work: Workload, tally: Tally, watches: list, minutes: float) -> None:
    """watches: what samples the cluster every 2 s (RSS, the speculating node's counters)."""
    rng = random.Random(args.seed)
    stop, gate = threading.Event(), Gate(args.clients)
    faults = Faults(cluster, tally, random.Random(rng.random()), gate, args.idle_s,
                    tuple(filter(None, args.lead.split(","))), args.deadline_s)
    clients = [Client(cluster.url, work, tally, random.Random(rng.random()), args.deadline_s, args.abandon_rate,
                      gate, faults.on_first_token) for _ in range(args.clients)]
    threads = [threading.Thread(target=c.run, args=(stop,), daemon=True) for c in clients]
    threads.append(threading.Thread(target=faults.run, args=(stop, tuple(args.fault_gap_s)), daemon=True))
    for t in threads:
        t.start()
    end = time.monotonic() + minutes * 60
    while time.monotonic() < end:
        for watch in watches:
            watch.sample()
        time.sleep(2)
    stop.set()
    gate.reopen()
    for t in threads:
        t.join(timeout=args.deadline_s + 10)
        if t.is_alive():
            tally.violate("hung", f"{t.name} still running {args.deadline_s:.0f} s after the soak ended")


def settle(cluster: SoakCluster, tally: Tally, lease_s: float) -> dict:
    """Every process back, then every count of held KV at 0; returns the router's /health."""
    if not cluster.wait_healthy(180):
        tally.violate("no recovery", "not every node healthy after the soak")
    deadline, body, held = time.monotonic() + lease_s + 30, None, None
    while time.monotonic() < deadline:
        body = cluster.health() or {}
        held = {n["id"]: (n.get("kv_blocks_in_use"), n.get("requests"), n.get("routed_requests"))
                for n in body.get("nodes", [])}
        if held and all(v == (0, 0, 0) for v in held.values()):
            return body
        time.sleep(1)
    tally.violate("held after the soak", f"(blocks, requests, routed) per node: {held}")
    return body or {}


def soak(args, cluster: SoakCluster, work: Workload, minutes: float) -> dict:
    """One cluster's soak, from its processes' start (launched earlier) to their stop."""
    tally = Tally()
    watch, drafts = RssWatch(cluster, minutes * 20), DraftCount(cluster)
    started, health, left = time.monotonic(), {}, []
    try:
        if not cluster.wait_healthy(240):
            tally.violate("no start", "not every process healthy 240 s after the start")
        tally.phases["start"] = time.monotonic() - started
        run_traffic(args, cluster, work, tally, [watch, drafts], minutes)
        tally.phases["traffic"] = time.monotonic() - started - tally.phases["start"]
        health = settle(cluster, tally, args.lease_s)
    finally:
        left = cluster.stop()
        tally.phases["settle"] = time.monotonic() - started - sum(tally.phases.values())
    for line in watch.violations():
        tally.violate("RSS", line)
    for proc in left:
        tally.violate("left behind", proc)
    return {"tally": tally, "watch": watch, "drafts": drafts, "health": health, "left": left, "seconds": time.monotonic() - started}


def soak_all(args, clusters: dict[str, SoakCluster], work: Workload) -> dict[str, dict]:
    """Each transport's soak in its own thread, side by side: the clusters share the machine's
    cores, and a CI-sized run waits for one start-up and one settle, not one per transport."""
    results: dict[str, dict] = {}
    errors: list[BaseException] = []

    def one(transport: str) -> None:
        try:
            results[transport] = soak(args, clusters[transport], work, args.minutes)
        except BaseException as exc:  # re-raised in the main thread, after the other soak ends
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(t,), name=f"soak-{t}") for t in clusters]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return {t: results[t] for t in clusters}  # in the order asked, not the order they ended


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pdserve-soak-") as tmp:
        logs = args.logs or Path(tmp)
        adapter = make_soak_adapter(Path(tmp) / "adapter")
        clusters = {t: SoakCluster(logs / t, args.lease_s, adapter, t, decode_tp=args.decode_tp) for t in args.transports}
        try:
            for cluster in clusters.values():
                cluster.launch()
            work = Workload(adapter)  # the offline engine's answers, computed while the clusters start
            results = soak_all(args, clusters, work)
        finally:
            for cluster in clusters.values():
                cluster.stop()
    result = report(args, results)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1, default=str))
    return 1 if any(r["tally"].violations for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
