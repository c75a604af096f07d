"""The soak's measures and its table: each process's RSS after warm-up and its peak since (the
router's too), and one table with a column per transport."""
from __future__ import annotations

import time

from benchmarks.soak_cluster import SoakCluster
from benchmarks.soak_load import MODES

# A node's RSS grows for its first minutes of traffic (allocator arenas, NIXL and UCX pools,
# compiled kernels) to a plateau: the bound holds from WARM_S after a process starts (or a third
# of a shorter run), measured from its RSS then. The router has none of those pools or kernels
# and is killed every minute or so by the faults, so it is measured from ROUTER_WARM_S.
WARM_S, ROUTER_WARM_S = 120.0, 20.0
RSS_SCALE, RSS_SLACK = 1.25, 64 << 20  # peak <= warm * RSS_SCALE + RSS_SLACK
RSS_BOUND = f"x{RSS_SCALE} + {RSS_SLACK >> 20} MiB"
UNMEASURED = ("redis",)  # (names starting so) Redis holds the store's data: its RSS is the cache's size, not a leak


class RssWatch:
    """Each process's RSS after its warm-up and its peak since, per pid (a restart starts anew)."""

    def __init__(self, cluster: SoakCluster, run_third_s: float):
        self.cluster = cluster
        self.warm_s = {"router": min(ROUTER_WARM_S, run_third_s), "node": min(WARM_S, run_third_s)}
        self.seen: dict[int, float] = {}
        self.warm: dict[int, tuple[str, int]] = {}
        self.peak: dict[int, int] = {}

    def sample(self) -> None:
        now, rss = time.monotonic(), self.cluster.rss()
        for name, proc in list(self.cluster.procs.items()):  # the owner's thread adds and removes nodes
            pid = proc.popen.pid if proc.popen else None
            if pid is None or not rss.get(name) or name.startswith(UNMEASURED):  # 0: exiting (a zombie holds no pages)
                continue
            started = self.seen.setdefault(pid, now)
            if now - started >= self.warm_s["router" if name == "router" else "node"]:
                self.warm.setdefault(pid, (name, rss[name]))
                self.peak[pid] = max(self.peak.get(pid, 0), rss[name])

    def violations(self) -> list[str]:
        return [f"{name} pid {pid}: {warm >> 20} MiB after warm-up, peak {self.peak[pid] >> 20} MiB"
                for pid, (name, warm) in self.warm.items() if self.peak[pid] > warm * RSS_SCALE + RSS_SLACK]

    def rows(self) -> list[tuple[str, str]]:
        """Per process name, its pids measured and the one that grew most: RSS after warm-up -> peak."""
        by_name: dict[str, list[int]] = {}
        for pid, (name, _) in self.warm.items():
            by_name.setdefault(name, []).append(pid)
        rows = []
        for name in sorted(by_name, key=lambda n: (n != "router", n)):
            pid = max(by_name[name], key=lambda p: self.peak[p] / self.warm[p][1])
            warm, peak = self.warm[pid][1], self.peak[pid]
            rows.append((f"RSS of {name}, MiB: after warm-up -> peak (processes measured)",
                         f"{warm >> 20} -> {peak >> 20} ({(peak - warm) / warm * 100:+.1f}%, {len(by_name[name])})"))
        return rows

    def growth(self) -> str:
        worst = max(((self.peak[p] - w) / w, n) for p, (n, w) in self.warm.items()) if self.warm else (0.0, "-")
        return f"{worst[0] * 100:+.1f}% ({worst[1]})"


class DraftCount:
    """The speculating node's drafts and accepted draft tokens over the whole run. Its counters
    restart with its process, so each sample adds what they grew by since the last one (all of
    them after a restart): a lower bound, short of what a node drafted between its last sample
    and its death."""

    def __init__(self, cluster: SoakCluster):
        self.cluster = cluster
        self.last, self.total = (0, 0), [0, 0]

    def sample(self) -> None:
        body = self.cluster.health() or {}
        node = next((n for n in body.get("nodes", []) if "spec_num_drafts" in n), None)
        if node is None:
            return
        now = (node["spec_num_drafts"], node["spec_num_accepted_tokens"])
        restarted = now[0] < self.last[0]
        for i in (0, 1):
            self.total[i] += now[i] - (0 if restarted else self.last[i])
        self.last = now


def rows(args, r: dict) -> list[tuple[str, object]]:
    c, watch, health = r["tally"].counts, r["watch"], r["health"]
    t = r["tally"]
    out = [("run", f"{r['seconds'] / 60:.1f} min, seed {args.seed}, {args.clients} clients"),
           ("start-up / traffic / settle and stop, s", " / ".join(f"{v:.0f}" for v in t.phases.values())),
           ("slowest recovery before a fault, s", t.slowest_recovery),
           ("requests sent", c["requests"]),
           ("completed, text identical (greedy / seeded / adapter / regex)",
            " / ".join(str(c[f"completed {m}"]) for m in MODES)),
           ("speculating decode node's drafts / accepted draft tokens", " / ".join(map(str, r["drafts"].total))),
           ("abandoned by their client", sum(v for k, v in c.items() if k.startswith("fault: client left"))),
           ("retried after an error (router or Redis down)", c["retries"]),
           ("requests after an idle pause / failed", f"{c['requests after an idle pause']} / {c['failed after idle']}"),
           ("slowest request, s (retries included)", "{} ({}, ended {})".format(*r["tally"].slowest)),
           ("lost", c["lost"]), ("text differs", c["text differs"]), ("hung", c["hung"]),
           ("blocks / requests held after", "0" if not c["held after the soak"] else "NOT 0"),
           (f"peak RSS growth after warm-up (bound {RSS_BOUND})", watch.growth()),
           ("processes left behind", len(r["left"]))]
    out += watch.rows()
    out += [(k, v) for k, v in sorted(c.items()) if k.startswith("fault: ")]
    if c["fault: drain during scale"]:
        out.append(("the switch during the scale: waited for it, then 'no node' / came first",
                    f"{c['switch during scale: waited for it']} / {c['switch during scale: came first']}"))
    out += [(f"router: {k}", v) for k, v in sorted(health.get("failover", {}).items())]
    return out


def report(args, results: dict[str, dict]) -> dict:
    """One table, a column per transport (a row missing in one: -); every violation after it."""
    per = {t: dict(rows(args, r)) for t, r in results.items()}
    names: list[str] = []
    for t in per:  # a row only one transport has goes after the row it follows there
        for k in per[t]:
            if k not in names:
                prev = [n for n in per[t] if n in names and list(per[t]).index(n) < list(per[t]).index(k)]
                names.insert(names.index(prev[-1]) + 1 if prev else len(names), k)
    print("\n| what | " + " | ".join(per) + " |\n|---|" + "---|" * len(per))
    for what in names:
        print(f"| {what} | " + " | ".join(str(per[t].get(what, "-")) for t in per) + " |")
    for t, r in results.items():
        for v in r["tally"].violations:
            print("VIOLATION", t, v)
    return {t: {"rows": list(per[t].items()), "violations": r["tally"].violations, "counts": dict(r["tally"].counts)}
            for t, r in results.items()}
