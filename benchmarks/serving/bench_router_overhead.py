"""The router's own added latency per request: direct zmq to the decode node vs HTTP via the router.

    .venv/bin/python -m benchmarks.serving.bench_router_overhead [--requests 200] [--max-tokens 1] \
        [--profile auto|always|never] [--output-json out.json]

Starts a monolithic cluster (`pdserve up --prefill-nodes 0`, 127.0.0.1 only), reads the decode
node's zmq address from /health, then sends N sequential tiny requests, interleaved (the order
alternates every iteration) between
  direct  a DEALER socket sending DecodeRequest(handover=None) to the decode node and waiting for
          the finished TokenDelta (what the router itself does per request), and
  router  POST /v1/completions (non-streaming, prompt as token ids) with a keep-alive httpx client.
Both get the same prompt in one iteration (a few random ids, under one KV block, so the prefix
cache never helps). Router-added latency = router - direct, per percentile, plus the median of the
per-iteration differences. A floor for plain HTTP (GET /v1/models, no backend work) is measured too.

CPU per request (robust on a busy machine, where latency percentiles are noisy): the router's and
the decode node's utime+stime (from /proc, all threads) over N router-only and N direct-only
requests.

Profiling (--profile auto: only when the p50 difference is over --target-ms): a second router,
instrumented in this file without touching pdserve's code, is started beside the cluster's and
pointed at the same decode node. It timestamps each request's stages with CLOCK_MONOTONIC (shared
by all processes of the machine, so the client's timestamps line up with it):
  client->asgi            httpx builds and sends, TCP, uvicorn/httptools parse, ASGI app called
  asgi->handler           Starlette/FastAPI routing, body read, JSON parse, pydantic validation
  handler->group          prompt and max_tokens checks, SamplingParams, flavor, request id, log line
  group->send             GenerationGroup tasks, ClusterBackend.generate(), DecodeRequest encoded
  send->delta             zmq to the node, the node's work, zmq back (compare with `direct`)
  delta->consumed         finished TokenDelta relayed: backend queue -> generate -> group queue -> collect
  consumed->closed        GenerationGroup.close(): cancel and gather its pump tasks
  closed->resp_start      response body dict, JSONResponse (json.dumps), back through FastAPI/Starlette
  resp_start->resp_end    ASGI send of headers and body
  resp_end->client        uvicorn writes, httpx reads and parses the response
and then runs the same requests under cProfile (main thread = the event loop) and prints the
functions with the most own time.
"""
from __future__ import annotations

import argparse
import contextvars
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.serving.router_overhead_clients import (
    STAGES,
    DirectClient,
    RawHTTPClient,
    RouterClient,
    cpu_per_request,
    cpu_table,
    measure,
    now_ns,
    summarize,
    table,
)
from benchmarks.support.cluster import http_json, local_cluster, source_info
from pdserve.testing.up_cluster import node_pids
from pdserve.wire.transport import free_port

# ------------------------------------------------------------------------------ instrumented router

def serve_instrumented_router(args: argparse.Namespace) -> int:
    """Runs pdserve's router app with timestamps around its stages (monkeypatched here, in this
    process only) and a /_bench route to read them and to switch cProfile on and off."""
    import cProfile
    import logging
    import pstats

    import uvicorn
    from fastapi.responses import JSONResponse, PlainTextResponse

    import pdserve.router.dispatch.node_events as events_mod
    import pdserve.router.dispatch.nodes as nodes_mod
    import pdserve.router.routes.app as app_mod
    from pdserve.router.main import build_app
    from pdserve.wire.messages import DecodeRequest as DR
    from pdserve.wire.messages import token_outputs as outputs_of

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    current: contextvars.ContextVar[dict | None] = contextvars.ContextVar("stamps", default=None)
    by_rid: dict[str, dict] = {}
    done: dict[str, dict] = {}

    class TimedGroup(app_mod.GenerationGroup):
        def __init__(self, backend, base_id, prompt_ids, params, **kwargs):
            stamps = current.get()
            if stamps is not None:
                stamps["group"] = now_ns()
                stamps["id"] = base_id
                for rid in (f"{base_id}-{i}" for i in range(len(params))):
                    by_rid[rid] = stamps
            self._stamps = stamps
            super().__init__(backend, base_id, prompt_ids, params, **kwargs)

        async def close(self):
            if self._stamps is not None:
                self._stamps["consumed"] = now_ns()
            await super().close()
            if self._stamps is not None:
                self._stamps["closed"] = now_ns()

    app_mod.GenerationGroup = TimedGroup
    real_job = app_mod.completion_job

    async def timed_job(router, body):
        stamps = current.get()
        if stamps is not None:
            stamps["handler"] = now_ns()
        return await real_job(router, body)

    app_mod.completion_job = timed_job
    real_encode = nodes_mod.encode  # the node pool encodes every message it sends

    def timed_encode(msg):
        if isinstance(msg, DR) and msg.request_id in by_rid:
            by_rid[msg.request_id]["send"] = now_ns()
        return real_encode(msg)

    nodes_mod.encode = timed_encode
    real_on_message = events_mod.NodeEvents.on_message

    def timed_on_message(self, node, msg):
        for out in outputs_of(msg):
            if out.finished and out.request_id in by_rid:
                by_rid[out.request_id]["delta"] = now_ns()
        return real_on_message(self, node, msg)

    events_mod.NodeEvents.on_message = timed_on_message
    app = build_app(args.model, [], [args.decode], "nixl", 16, "float32", None)
    profiler: dict[str, Any] = {}

    @app.get("/_bench/timings")
    async def timings():
        out = dict(done)
        done.clear()
        return JSONResponse(out)

    @app.post("/_bench/profile/{action}")
    async def profile(action: str):
        if action == "start":
            profiler["p"] = cProfile.Profile()
            profiler["p"].enable()
            return PlainTextResponse("started")
        prof = profiler.pop("p")
        prof.disable()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(35)
        stats.sort_stats("cumulative").print_stats(45)
        stats.print_callers(r"wait_for|call_later|create_task|info\b")
        return PlainTextResponse(text.getvalue())

    async def asgi(scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/completions"):
            return await app(scope, receive, send)
        stamps = {"asgi_in": now_ns()}
        current.set(stamps)

        async def timed_send(message):
            if message["type"] == "http.response.start":
                stamps["resp_start"] = now_ns()
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                stamps["resp_end"] = now_ns()  # handed to uvicorn: the router's work is done
            await send(message)

        try:
            await app(scope, receive, timed_send)
        finally:
            if "id" in stamps:
                done[stamps["id"]] = stamps
                for rid in [r for r, s in by_rid.items() if s is stamps]:
                    by_rid.pop(rid, None)

    uvicorn.run(asgi, host="127.0.0.1", port=args.port, log_level="warning", timeout_graceful_shutdown=2)
    return 0


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"instrumented router exited with {proc.returncode}")
        try:
            if http_json(f"{url}/health", 2).get("healthy"):
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise TimeoutError("instrumented router never became healthy")


def profile_router(args, decode_addr: str, log_dir: Path) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = log_dir / "instrumented-router.log"
    cmd = [sys.executable, "-m", __spec__.name, "_serve-router", "--port", str(port),
           "--decode", decode_addr, "--model", args.model, "--log-level", args.log_level]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    out: dict[str, Any] = {"log": str(log_path)}
    try:
        wait_http(url, proc, 120)
        direct = DirectClient(decode_addr, args.request_timeout_s)
        router = RouterClient(url, args.request_timeout_s)
        raw = RawHTTPClient(url, router.model, args.request_timeout_s)
        try:
            # 1. Same interleaved measurement against the instrumented router (overhead of the
            #    instrumentation itself is a few us per stamp).
            out["measurement"] = measure(direct, router, args.requests, args.warmup, args.prompt_len,
                                         args.max_tokens, args.seed + 1, (args.min_token_id, args.max_token_id),
                                         raw)
            # 2. Stage breakdown: router requests only, client stamps joined with the server's.
            rng = random.Random(args.seed + 2)
            router.client.get("/_bench/timings")
            client_stamps = []
            for _ in range(args.requests):
                prompt = [rng.randrange(args.min_token_id, args.max_token_id) for _ in range(args.prompt_len)]
                st: dict = {}
                router.request(prompt, args.max_tokens, st)
                client_stamps.append(st)
            server = router.client.get("/_bench/timings").json()
            stages: dict[str, list[float]] = {name: [] for name, _, _ in STAGES}
            stages["total"] = []
            for st in client_stamps:
                s = {**server.get(st["id"], {}), **st}
                if not all(k in s for _, a, b in STAGES for k in (a, b)):
                    continue
                for name, a, b in STAGES:
                    stages[name].append((s[b] - s[a]) / 1e9)
                stages["total"].append((s["client_done"] - s["client_send"]) / 1e9)
            out["stages"] = {k: summarize(v) for k, v in stages.items() if v}
            # 3. cProfile of the router's event loop thread over the same kind of requests.
            router.client.post("/_bench/profile/start")
            for _ in range(args.requests):
                prompt = [rng.randrange(args.min_token_id, args.max_token_id) for _ in range(args.prompt_len)]
                router.request(prompt, args.max_tokens)
            out["cprofile"] = router.client.post("/_bench/profile/stop").text
        finally:
            direct.close()
            router.close()
            raw.close()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
            out["stopped_cleanly"] = True
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            out["stopped_cleanly"] = False
    return out


def stage_table(stages: dict[str, dict]) -> str:
    lines = ["| stage (instrumented router) | p50 ms | p90 ms | p99 ms | mean ms |", "|---|---|---|---|---|"]
    for name in [*(s[0] for s in STAGES), "total"]:
        if name in stages:
            s = stages[name]
            lines.append(f"| {name} | {s['p50']:.3f} | {s['p90']:.3f} | {s['p99']:.3f} | {s['mean']:.3f} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ main

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "_serve-router":
        p = argparse.ArgumentParser()
        p.add_argument("mode")
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--decode", required=True)
        p.add_argument("--model", default="builtin:tiny")
        p.add_argument("--log-level", default="INFO")
        return p.parse_args(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="builtin:tiny")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--min-token-id", type=int, default=100)
    p.add_argument("--max-token-id", type=int, default=250, help="exclusive; builtin:tiny has 261 ids")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-ms", type=float, default=2.0, help="router-added p50 target")
    p.add_argument("--profile", choices=["auto", "always", "never"], default="auto")
    p.add_argument("--log-level", default="INFO", help="for the cluster and the instrumented router "
                   "(INFO is pdserve's default; the router logs one line per request at INFO)")
    p.add_argument("--request-timeout-s", type=float, default=30.0)
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    args.mode = "bench"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.mode == "_serve-router":
        return serve_instrumented_router(args)

    def on_term(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    log_dir = Path(args.log_dir or f"/tmp/pdserve-bench-router-{time.strftime('%Y%m%d-%H%M%S')}")
    log_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"args": vars(args), "source": source_info()}
    with local_cluster("--model", args.model, "--prefill-nodes", "0", "--decode-nodes", "1",
                       log_path=str(log_dir / "cluster.log"), startup_timeout_s=args.startup_timeout_s,
                       log_level=args.log_level) as c:
        decode_addr = next(n["address"] for n in c.health()["nodes"] if n["role"] == "decode")
        report["decode_address"] = decode_addr
        direct = DirectClient(decode_addr, args.request_timeout_s)
        router = RouterClient(c.url, args.request_timeout_s)
        raw = RawHTTPClient(c.url, router.model, args.request_timeout_s)
        try:
            res = measure(direct, router, args.requests, args.warmup, args.prompt_len, args.max_tokens,
                          args.seed, (args.min_token_id, args.max_token_id), raw)
            pids = node_pids(c.proc.pid)
            report["pids"] = pids
            report["cpu"] = cpu_per_request(direct, router, raw, pids, args.requests, args.prompt_len,
                                            args.max_tokens, args.seed + 3, (args.min_token_id, args.max_token_id))
        finally:
            direct.close()
            router.close()
            raw.close()
        report["result"] = res
        print(f"{args.requests} sequential requests each way (interleaved), prompt {args.prompt_len} ids, "
              f"max_tokens {args.max_tokens}, model {args.model}, log level {args.log_level}, "
              f"pdserve {report['source'].get('commit')}\n")
        print(table(res))
        print("\nCPU time per request (utime+stime over all threads, /proc; 10 ms ticks over "
              f"{args.requests} requests):\n")
        print(cpu_table(report["cpu"]))
        over = max(res["added"]["p50"], res["added_raw"]["p50"]) > args.target_ms
        print(f"\nrouter-added p50: {res['added']['p50']:.3f} ms with httpx, {res['added_raw']['p50']:.3f} ms "
              f"with the raw-socket client (target < {args.target_ms} ms: {'MISSED' if over else 'met'})")
        if args.profile == "always" or (args.profile == "auto" and over):
            prof = profile_router(args, decode_addr, log_dir)
            report["profile"] = prof
            if "measurement" in prof:
                print("\nInstrumented router (same decode node), interleaved again:\n")
                print(table(prof["measurement"]))
            if "stages" in prof:
                print("\nWhere a request's time goes (CLOCK_MONOTONIC stamps, client and router):\n")
                print(stage_table(prof["stages"]))
            if "cprofile" in prof:
                (log_dir / "router-cprofile.txt").write_text(prof["cprofile"])
                print(f"\ncProfile of the router's event loop: {log_dir / 'router-cprofile.txt'}")
    report["cluster"] = {"startup_s": c.startup_s, "stop_s": c.stop_s, "stopped_cleanly": c.stopped_cleanly,
                         "up_returncode": c.up_returncode, "leftover_pids": c.leftover_pids}
    if not c.stopped_cleanly or c.leftover_pids or c.up_returncode != 0:
        print(f"\n!! the cluster did not stop cleanly: {report['cluster']} (log {log_dir / 'cluster.log'})")
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
