"""Where router processes saturate: requests/s and relayed tokens/s for 1, 2 and 4 routers.

    .venv/bin/python -m benchmarks.serving.bench_router_saturation [--routers 1 2 4] [--runs 3] \
        [--duration-s 5] [--connections 32] [--stream-tokens 64] [--output-json out.json]

Fake decode nodes answer instantly, so only the routers' own work is measured: each fake node is
a zmq ROUTER socket that answers Ping with a Pong, a KV snapshot request with an empty snapshot,
and a DecodeRequest with max_tokens TokenDeltas at once, one token each (as a real decode node
streams one delta per step). Every router (`pdserve router --decode ...`, 127.0.0.1 only, its
own process) connects to every fake node. One client process (asyncio, raw HTTP/1.1 keep-alive
connections, spread round robin over the routers) keeps --connections requests in flight for
--duration-s after a warm-up, in two workloads:
  requests  non-streaming, max_tokens 1: HTTP, validation and routing per request;
  tokens    streaming (SSE), max_tokens --stream-tokens: the per-token relay, node -> client.
Each run measures 1, 2 and 4 routers in turn (fresh router processes); the table gives the
median over --runs runs. CPU seconds of the routers, the fake nodes and the client are read from
/proc over each window, and the 1-minute load average after it, because on a small shared
machine the routers cannot use more cores than there are.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import zmq

from benchmarks.serving.bench_router_overhead import proc_cpu_s
from benchmarks.support.cluster import source_info
from pdserve.protocol.outputs import StepOutput
from pdserve.wire.messages import DecodeRequest, KVEvents, KVSnapshotRequest, Ping, Pong, TokenDelta
from pdserve.wire.messages import decode as decode_msg
from pdserve.wire.messages import encode as encode_msg
from pdserve.wire.transport import free_port

MODEL = "builtin:tiny"
WORKLOADS = ("requests", "tokens")
REQUEST_TIMEOUT_S = 30.0


# ------------------------------------------------------------------------------ fake nodes

def answer(node_id: str, msg) -> list:
    """What an instant decode node sends back for one message."""
    if isinstance(msg, Ping):
        return [Pong(msg.seq, node_id, "decode", free_blocks=1 << 20, total_blocks=1 << 20)]
    if isinstance(msg, KVSnapshotRequest):
        return [KVEvents(node_id=node_id, epoch=1, seq=0, snapshot=True)]
    if isinstance(msg, DecodeRequest):
        n = msg.params.max_tokens
        return [TokenDelta(StepOutput(msg.request_id, [100 + i % 100], " x", i == n - 1,
                                      "length" if i == n - 1 else None, num_prompt_tokens=len(msg.prompt_token_ids)))
                for i in range(n)]
    return []  # Abort and anything else: nothing to do


def serve_fake_nodes(ports: list[int]) -> int:
    """Several fake decode nodes in one process (one socket each), polled together."""
    ctx = zmq.Context()
    poller, sockets = zmq.Poller(), {}
    for i, port in enumerate(ports):
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"tcp://127.0.0.1:{port}")
        poller.register(sock, zmq.POLLIN)
        sockets[sock] = f"fake-{i}"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        for sock, _ in poller.poll():
            while True:
                try:
                    ident, data = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                for reply in answer(sockets[sock], decode_msg(data)):
                    sock.send_multipart([ident, encode_msg(reply)])


# ------------------------------------------------------------------------------ processes

def spawn(argv: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def start_routers(count: int, node_ports: list[int], log_dir: Path, log_level: str) -> tuple[list, list[str]]:
    procs, urls = [], []
    for i in range(count):
        port = free_port()
        argv = [sys.executable, "-m", "pdserve", "--log-level", log_level, "router", "--model", MODEL,
                "--host", "127.0.0.1", "--port", str(port), "--max-queued-requests", "100000"]
        for node_port in node_ports:
            argv += ["--decode", f"tcp://127.0.0.1:{node_port}"]
        procs.append(spawn(argv, log_dir / f"router-{count}-{i}.log"))
        urls.append(f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 120
    for proc, url in zip(procs, urls):
        while True:
            try:
                nodes = httpx.get(f"{url}/health", timeout=2).json()["nodes"]
                if len(nodes) == len(node_ports) and all(n["healthy"] for n in nodes):
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                stop(procs)
                raise RuntimeError(f"router {url} did not start (see {log_dir})")
            time.sleep(0.2)
    return procs, urls


# ------------------------------------------------------------------------------ the client

class Tally:
    def __init__(self):
        self.requests = self.tokens = self.events = self.errors = 0
        self.counting = False


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One HTTP/1.1 response (Content-Length or chunked): status and body."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    headers = head.lower()
    if b"transfer-encoding: chunked" in headers:
        parts = []
        while (size := int((await reader.readuntil(b"\r\n")).strip(), 16)) > 0:
            parts.append((await reader.readexactly(size + 2))[:-2])
        await reader.readuntil(b"\r\n")
        return status, b"".join(parts)
    length = int(headers.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
    return status, await reader.readexactly(length)


async def connection(url: str, stream: bool, max_tokens: int, tally: Tally, stop_at: float, seed: int) -> None:
    """One keep-alive connection sending requests back to back until stop_at; a request that
    fails or takes over REQUEST_TIMEOUT_S counts as an error and the connection is opened again."""
    host, port = url.removeprefix("http://").split(":")
    rng = random.Random(seed)
    while time.monotonic() < stop_at:
        writer = None
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
            while time.monotonic() < stop_at:
                body = json.dumps({"model": MODEL, "prompt": [rng.randrange(100, 250) for _ in range(8)],
                                   "max_tokens": max_tokens, "temperature": 0, "stream": stream,
                                   "ignore_eos": True}).encode()
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body))
                status, payload = await asyncio.wait_for(read_response(reader), REQUEST_TIMEOUT_S)
                done = status == 200 and (not stream or payload.rstrip().endswith(b"data: [DONE]"))
                if tally.counting:
                    tally.requests += done
                    tally.errors += not done
                    tally.tokens += max_tokens if done else 0
                    tally.events += payload.count(b"data: {") if stream else done
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, IndexError):
            tally.errors += tally.counting
        finally:
            if writer is not None:
                writer.close()


async def load(urls: list[str], connections: int, stream: bool, max_tokens: int, warmup_s: float,
               duration_s: float, on_window) -> Tally:
    """Keep `connections` requests in flight; count only those that end inside the window."""
    tally = Tally()
    stop_at = time.monotonic() + warmup_s + duration_s
    tasks = [asyncio.create_task(connection(urls[i % len(urls)], stream, max_tokens, tally, stop_at, i))
             for i in range(connections)]
    await asyncio.sleep(warmup_s)
    tally.counting = True
    on_window("start")
    await asyncio.sleep(duration_s)
    tally.counting = False
    on_window("end")
    await asyncio.gather(*tasks)
    return tally


def measure(urls: list[str], pids: dict[str, list[int]], workload: str, args) -> dict:
    stream = workload == "tokens"
    max_tokens = args.stream_tokens if stream else 1
    cpu: dict[str, float] = {}

    def on_window(edge: str) -> None:
        sign = -1 if edge == "start" else 1
        for group, group_pids in pids.items():
            cpu[group] = cpu.get(group, 0.0) + sign * sum(proc_cpu_s(p) for p in group_pids)
        cpu["client"] = cpu.get("client", 0.0) + sign * time.process_time()

    tally = asyncio.run(load(urls, args.connections, stream, max_tokens, args.warmup_s, args.duration_s, on_window))
    d = args.duration_s
    # CPU per unit of work holds on a shared machine, where the cores the routers get do not.
    per_unit_us = 1e6 * cpu["routers"] / max(tally.tokens if stream else tally.requests, 1)
    return {"requests_per_s": tally.requests / d, "tokens_per_s": tally.tokens / d, "sse_events_per_s": tally.events / d,
            "router_cpu_us_per_unit": per_unit_us, "errors": tally.errors, "cores": {k: v / d for k, v in cpu.items()},
            "load_1min": os.getloadavg()[0]}


# ------------------------------------------------------------------------------ the report

def medians(runs: list[dict], counts: list[int]) -> dict:
    out = {}
    for n in counts:
        for w in WORKLOADS:
            rows = [r[str(n)][w] for r in runs]
            out[f"{n}/{w}"] = {key: statistics.median(row[key] for row in rows)
                               for key in ("requests_per_s", "tokens_per_s", "sse_events_per_s", "router_cpu_us_per_unit",
                                           "load_1min")}
            out[f"{n}/{w}"]["errors"] = sum(row["errors"] for row in rows)
            out[f"{n}/{w}"]["cores"] = {k: statistics.median(row["cores"][k] for row in rows) for k in rows[0]["cores"]}
    return out


def table(med: dict, counts: list[int], args) -> str:
    lines = ["| routers | requests/s (max_tokens 1) | router CPU per request | relayed tokens/s (stream, "
             f"{args.stream_tokens} tokens) | router CPU per token | router cores used (req / tok) | "
             "client + fake-node cores (tok) | load avg 1 min | errors |", "|---|---|---|---|---|---|---|---|---|"]
    for n in counts:
        r, t = med[f"{n}/requests"], med[f"{n}/tokens"]
        lines.append(f"| {n} | {r['requests_per_s']:.0f} | {r['router_cpu_us_per_unit'] / 1000:.2f} ms | "
                     f"{t['tokens_per_s']:.0f} | {t['router_cpu_us_per_unit']:.0f} us | "
                     f"{r['cores']['routers']:.2f} / {t['cores']['routers']:.2f} | "
                     f"{t['cores']['client']:.2f} + {t['cores']['fake_nodes']:.2f} | "
                     f"{max(r['load_1min'], t['load_1min']):.1f} | {r['errors'] + t['errors']} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--routers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--fake-nodes", type=int, default=2)
    p.add_argument("--connections", type=int, default=32, help="requests in flight, over all routers")
    p.add_argument("--stream-tokens", type=int, default=64)
    p.add_argument("--warmup-s", type=float, default=1.0)
    p.add_argument("--duration-s", type=float, default=5.0)
    p.add_argument("--log-level", default="WARNING", help="the routers' (INFO logs a line per request)")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--output-json", default=None)
    p.add_argument("--serve-fake-nodes", type=int, nargs="+", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_fake_nodes:
        return serve_fake_nodes(args.serve_fake_nodes)
    log_dir = Path(args.log_dir or f"/tmp/pdserve-bench-saturation-{time.strftime('%Y%m%d-%H%M%S')}")
    log_dir.mkdir(parents=True, exist_ok=True)
    node_ports = [free_port() for _ in range(args.fake_nodes)]
    fake = spawn([sys.executable, "-m", __spec__.name, "--serve-fake-nodes", *map(str, node_ports)],
                 log_dir / "fake-nodes.log")
    runs: list[dict] = []
    try:
        for run in range(args.runs):
            runs.append({})
            for n in args.routers:
                routers, urls = start_routers(n, node_ports, log_dir, args.log_level)
                try:
                    pids = {"routers": [p.pid for p in routers], "fake_nodes": [fake.pid]}
                    runs[-1][str(n)] = {w: measure(urls, pids, w, args) for w in WORKLOADS}
                finally:
                    stop(routers)
                res = runs[-1][str(n)]
                print(f"run {run + 1}, {n} router(s): {res['requests']['requests_per_s']:.0f} req/s, "
                      f"{res['tokens']['tokens_per_s']:.0f} tok/s, load {res['tokens']['load_1min']:.1f}", flush=True)
    finally:
        stop([fake])
    med = medians(runs, args.routers)
    print(f"\nmedians of {args.runs} runs; {args.connections} connections, {args.fake_nodes} fake decode nodes, "
          f"{os.cpu_count()} cores, routers at log level {args.log_level}\n")
    print(table(med, args.routers, args))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"args": vars(args), "source": source_info(), "runs": runs,
                                                      "medians": med}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
