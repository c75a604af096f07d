"""What a role switch costs against starting a new node, on one running `pdserve up` cluster.

    .venv/bin/python -m benchmarks.serving.bench_role_switch [--repeats 5] [--model builtin:tiny]

Each repeat, as the router's admin API sees it (client-side wall time of the call, which answers
once the node serves in its new shape):
  * switch: prefill-0 -> decode -> prefill (drain, rebuild the other role over the same engine and
    control socket, first pong in the new role); the process, weights and KV cache stay;
  * new node: scale prefill 1 -> 2 (a process starts, imports, loads weights, allocates its KV
    cache, answers its first pong), then 2 -> 1 (drain and stop).
The node's own rebuild time (from its log: "... is a decode node now (X s to switch)") is printed
too. A warm-up prompt leaves blocks in prefill-0's prefix cache; the last line lists its cached
block count before and after each round of switches. Prints medians.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
import urllib.request

from benchmarks.support.cluster import local_cluster


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", default="builtin:tiny")
    p.add_argument("--kv-transfer", default="nixl", choices=["nixl", "store"])
    p.add_argument("--log", default="/tmp/bench_role_switch.log")
    return p.parse_args()


def post(url: str, path: str, body: dict) -> tuple[float, dict]:
    req = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        reply = json.loads(resp.read())
    return time.perf_counter() - t0, reply


def warm_prefix(url: str) -> None:
    body = {"prompt": "a prompt whose blocks stay in the prefill node's cache " * 8, "max_tokens": 1}
    post(url, "/v1/completions", body)


def node_rebuild_times(log_path: str) -> list[float]:
    with open(log_path, errors="replace") as f:
        return [float(x) for x in re.findall(r"is a \w+ node now \(([0-9.]+) s to switch\)", f.read())]


def main() -> int:
    args = parse_args()
    rows: dict[str, list[float]] = {"switch prefill->decode": [], "switch decode->prefill": [],
                                    "new prefill node (scale 1->2)": [], "remove it (scale 2->1, drain+stop)": []}
    kept: list[tuple[int, int]] = []  # prefill-0's cached blocks before and after each round of switches
    with local_cluster("--prefill-nodes", "1", "--decode-nodes", "1", "--kv-transfer", args.kv_transfer,
                       "--model", args.model, "--local-prefill-threshold", "0", log_path=args.log,
                       log_level="INFO") as c:
        warm_prefix(c.url)
        time.sleep(1.0)  # the node's cache size reaches the router in its next pongs
        for _ in range(args.repeats):
            cached = c.nodes()["prefill-0"]["cached_blocks"]
            for to_role in ("decode", "prefill"):
                seconds, _ = post(c.url, "/admin/switch", {"node_id": "prefill-0", "to_role": to_role})
                rows[f"switch {'prefill->decode' if to_role == 'decode' else 'decode->prefill'}"].append(seconds)
            kept.append((cached, c.nodes()["prefill-0"].get("cached_blocks", -1)))
            seconds, _ = post(c.url, "/admin/scale", {"prefill": 2})
            rows["new prefill node (scale 1->2)"].append(seconds)
            seconds, _ = post(c.url, "/admin/scale", {"prefill": 1, "remove": [n for n in c.nodes() if n != "prefill-0"
                                                                                and n.startswith("prefill")]})
            rows["remove it (scale 2->1, drain+stop)"].append(seconds)
        rebuild = node_rebuild_times(args.log)
    print(f"model {args.model}, kv transfer {args.kv_transfer}, {args.repeats} repeats (medians, seconds)")
    print("| action | median s | min s | max s |\n| --- | --- | --- | --- |")
    for name, values in rows.items():
        print(f"| {name} | {statistics.median(values):.3f} | {min(values):.3f} | {max(values):.3f} |")
    if rebuild:
        print(f"| node-side rebuild of the other role (from its log) | {statistics.median(rebuild):.3f} | "
              f"{min(rebuild):.3f} | {max(rebuild):.3f} |")
    new, switch = statistics.median(rows["new prefill node (scale 1->2)"]), statistics.median(
        rows["switch prefill->decode"])
    print(f"new node / switch: {new / switch:.1f}x; prefill-0's cached blocks before/after each round: {kept}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
