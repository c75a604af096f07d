"""bench_router_overhead's measuring side: the clients it times (direct zmq to the decode node,
HTTP through the router, a raw socket), the interleaved measurement, CPU a request from /proc,
and the tables it prints."""
from __future__ import annotations

import json
import os
import random
import statistics
import time
from typing import Any

import httpx
import zmq

from pdserve.loadgen.metrics import percentile
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.wire.messages import DecodeRequest, decode, encode, token_outputs

QS = (50, 90, 99)
STAGES = [("client->asgi", "client_send", "asgi_in"), ("asgi->handler", "asgi_in", "handler"),
          ("handler->group", "handler", "group"), ("group->send", "group", "send"),
          ("send->delta", "send", "delta"), ("delta->consumed", "delta", "consumed"),
          ("consumed->closed", "consumed", "closed"), ("closed->resp_start", "closed", "resp_start"),
          ("resp_start->resp_end", "resp_start", "resp_end"), ("resp_end->client", "resp_end", "client_done")]


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


# ------------------------------------------------------------------------------ clients

class DirectClient:
    """What the router does per request, minus HTTP: DecodeRequest out, TokenDeltas back."""

    def __init__(self, address: str, timeout_s: float):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.timeout_ms = int(timeout_s * 1000)
        self.n = 0

    def request(self, prompt: list[int], max_tokens: int) -> tuple[float, int]:
        self.n += 1
        rid = f"direct-{os.getpid()}-{self.n}"
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        self.sock.send(encode(DecodeRequest(rid, prompt, params)))
        tokens = 0
        while True:
            if not self.sock.poll(self.timeout_ms):
                raise TimeoutError(f"no finished TokenDelta for {rid} in {self.timeout_ms} ms")
            for out in token_outputs(decode(self.sock.recv())):
                if out.request_id != rid:
                    continue
                tokens += len(out.new_token_ids)
                if out.finished:
                    if out.finish_reason == "error":
                        raise RuntimeError(f"direct request failed: {out.error}")
                    return time.perf_counter() - t0, tokens

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


class RouterClient:
    def __init__(self, url: str, timeout_s: float):
        self.client = httpx.Client(base_url=url, timeout=timeout_s)
        self.model = self.client.get("/v1/models").json()["data"][0]["id"]

    def request(self, prompt: list[int], max_tokens: int, stamps: dict | None = None) -> tuple[float, int]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True}
        t0 = time.perf_counter()
        if stamps is not None:
            stamps["client_send"] = now_ns()
        resp = self.client.post("/v1/completions", json=body)
        data = resp.json()
        if stamps is not None:
            stamps["client_done"] = now_ns()
            stamps["id"] = data.get("id")
        dt = time.perf_counter() - t0
        if resp.status_code != 200:
            raise RuntimeError(f"router answered HTTP {resp.status_code}: {resp.text[:300]}")
        return dt, data["usage"]["completion_tokens"]

    def floor(self) -> float:
        t0 = time.perf_counter()
        self.client.get("/v1/models").raise_for_status()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.client.close()


def summarize(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    return {f"p{q}": percentile(ms, q) for q in QS} | {"mean": statistics.fmean(ms), "n": len(ms)}


def measure(direct: DirectClient, router: RouterClient, n: int, warmup: int, prompt_len: int,
            max_tokens: int, seed: int, vocab: tuple[int, int], raw: RawHTTPClient | None = None
            ) -> dict[str, Any]:
    """Each iteration sends one prompt down every path; the order rotates per iteration."""
    rng = random.Random(seed)
    paths = {"direct": direct.request, "router": router.request}
    if raw is not None:
        paths["router_raw"] = raw.request
    names = list(paths)
    times: dict[str, list[float]] = {k: [] for k in names}
    floor: list[float] = []
    for i in range(warmup + n):
        prompt = [rng.randrange(*vocab) for _ in range(prompt_len)]
        res = {}
        for j in range(len(names)):
            name = names[(i + j) % len(names)]
            res[name], tok = paths[name](prompt, max_tokens)
            if tok != max_tokens:
                raise RuntimeError(f"{name}: expected {max_tokens} tokens, got {tok}")
        fl = router.floor()
        if i >= warmup:
            for name in names:
                times[name].append(res[name])
            floor.append(fl)
    out = {name: summarize(v) for name, v in times.items()} | {"http_floor": summarize(floor)}
    for name, suffix in (("router", ""), ("router_raw", "_raw")):
        if name in times:
            out["paired_diff" + suffix] = summarize([b - a for a, b in zip(times["direct"], times[name])])
            out["added" + suffix] = {f"p{q}": out[name][f"p{q}"] - out["direct"][f"p{q}"] for q in QS}
    return out


class RawHTTPClient:
    """A minimal keep-alive HTTP/1.1 client on a plain socket: the same POST as RouterClient with
    almost no client-side cost, so the router's share is not hidden behind httpx's."""

    def __init__(self, url: str, model: str, timeout_s: float):
        import socket
        host, port = url.removeprefix("http://").split(":")
        self.host = f"{host}:{port}"
        self.model = model
        self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def request(self, prompt: list[int], max_tokens: int) -> tuple[float, int]:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0.0, "ignore_eos": True}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        t0 = time.perf_counter()
        self.sock.sendall(head + body)
        while b"\r\n\r\n" not in self.buf:
            self._read()
        header, self.buf = self.buf.split(b"\r\n\r\n", 1)
        length = next(int(line.split(b":", 1)[1]) for line in header.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(self.buf) < length:
            self._read()
        payload, self.buf = self.buf[:length], self.buf[length:]
        dt = time.perf_counter() - t0
        if not header.startswith(b"HTTP/1.1 200"):
            status = header.split(b"\r\n", 1)[0]
            raise RuntimeError(f"router answered {status!r}: {payload[:300]!r}")
        return dt, json.loads(payload)["usage"]["completion_tokens"]

    def _read(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("the router closed the connection")
        self.buf += chunk

    def close(self) -> None:
        self.sock.close()


def proc_cpu_s(pid: int) -> float:
    """utime + stime of every thread of pid, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_per_request(direct: DirectClient, router: RouterClient, raw: RawHTTPClient, pids: dict[str, int],
                    n: int, prompt_len: int, max_tokens: int, seed: int, vocab: tuple[int, int]) -> dict[str, Any]:
    """CPU seconds each process spent per request, router-only then direct-only (the client's
    own CPU from process_time: httpx or zmq+msgspec, all its threads)."""
    rng = random.Random(seed)
    out: dict[str, Any] = {}
    for label, send in (("router", router.request), ("router_raw", raw.request), ("direct", direct.request)):
        prompts = [[rng.randrange(*vocab) for _ in range(prompt_len)] for _ in range(n)]
        before = {k: proc_cpu_s(p) for k, p in pids.items()}
        c0, t0 = time.process_time(), time.perf_counter()
        for prompt in prompts:
            send(prompt, max_tokens)
        wall, client = time.perf_counter() - t0, time.process_time() - c0
        out[label] = {k: (proc_cpu_s(p) - before[k]) / n * 1000 for k, p in pids.items()}
        out[label]["client (this process)"] = client / n * 1000
        out[label]["wall_ms"] = wall / n * 1000
    return out


def cpu_table(cpu: dict[str, Any]) -> str:
    procs = [k for k in cpu["router"] if k != "wall_ms"]
    lines = ["| requests sent | " + " | ".join(f"{p} CPU ms/req" for p in procs) + " | wall ms/req |",
             "|---|" + "---|" * (len(procs) + 1)]
    for label, title in (("router", "via router, httpx client"), ("router_raw", "via router, raw-socket client"),
                         ("direct", "direct zmq -> decode node")):
        lines.append(f"| {title} | " + " | ".join(f"{cpu[label][p]:.3f}" for p in procs)
                     + f" | {cpu[label]['wall_ms']:.3f} |")
    return "\n".join(lines)


def table(res: dict[str, Any]) -> str:
    lines = ["| path | p50 ms | p90 ms | p99 ms | mean ms |", "|---|---|---|---|---|"]
    rows = (("direct zmq -> decode node", "direct"), ("via router, httpx client", "router"),
            ("router-added, httpx (router - direct, per percentile)", "added"),
            ("router-added, httpx (per-iteration difference)", "paired_diff"),
            ("via router, raw-socket HTTP client", "router_raw"),
            ("router-added, raw socket (router - direct, per percentile)", "added_raw"),
            ("router-added, raw socket (per-iteration difference)", "paired_diff_raw"),
            ("HTTP floor: GET /v1/models (httpx, no backend)", "http_floor"))
    for label, key in rows:
        if key not in res:
            continue
        s = res[key]
        mean = f"{s['mean']:.3f}" if "mean" in s else "-"
        lines.append(f"| {label} | {s['p50']:.3f} | {s['p90']:.3f} | {s['p99']:.3f} | {mean} |")
    return "\n".join(lines)
