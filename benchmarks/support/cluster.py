"""Start and stop a local `pdserve up` cluster for benchmarks (127.0.0.1 only).

    with local_cluster("--prefill-nodes", "0", log_path="up.log") as c:
        print(c.url, c.health()["nodes"])

`pdserve up` runs in its own session with its output in a log file (never a pipe, which a chatty
cluster could fill and block on). Stopping sends SIGTERM to `pdserve up` and waits; if it does not
exit in time the whole process group is killed and `StoppedUncleanly` records why. Node processes
that outlive `pdserve up` are reported in `leftover_pids` (and killed).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx

from pdserve.wire.transport import free_port


class ClusterError(RuntimeError):
    pass


@dataclass
class Cluster:
    url: str
    proc: subprocess.Popen
    log_path: str
    flags: tuple[str, ...]
    startup_s: float = 0.0
    stop_s: float = 0.0
    stopped_cleanly: bool | None = None
    up_returncode: int | None = None
    leftover_pids: list[int] = field(default_factory=list)

    def health(self, timeout_s: float = 5.0) -> dict:
        return http_json(f"{self.url}/health", timeout_s)

    def nodes(self) -> dict[str, dict]:
        return {n["id"]: n for n in self.health()["nodes"]}

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n_chars:]
        except OSError:
            return ""


def http_json(url: str, timeout_s: float = 5.0) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # /health answers 503 with a JSON body while starting
        return json.loads(exc.read() or b"{}")


def ttft_ms(client: httpx.Client, url: str, model: str, prompt: list[int]) -> float:
    """Time to the first streamed token of a 2-token greedy completion, over a keep-alive client."""
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0 = time.perf_counter()
    ttft = None
    with client.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        # Read to the end: a client that leaves at its first token aborts the request, and the
        # decode node then drops the prefix it was loading (the router's index still names it).
        for line in r.iter_lines():
            if ttft is None and line.startswith("data: {"):
                ttft = (time.perf_counter() - t0) * 1e3
    if ttft is None:
        raise RuntimeError("no token streamed")
    return ttft


def descendant_pids(pid: int) -> list[int]:
    """Every descendant of pid (read from /proc, so no psutil is needed)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_healthy(c: Cluster, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if c.proc.poll() is not None:
            raise ClusterError(f"pdserve up exited early with code {c.proc.returncode}:\n{c.log_tail()}")
        try:
            info = c.health(timeout_s=2.0)
            if info.get("healthy") and all(n.get("healthy") for n in info.get("nodes", [])):
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.25)
    raise ClusterError(f"the cluster was not healthy within {timeout_s:.0f} s:\n{c.log_tail()}")


def stop_cluster(c: Cluster, timeout_s: float = 30.0) -> None:
    if c.stopped_cleanly is not None:
        return
    t0 = time.monotonic()
    descendants = descendant_pids(c.proc.pid)
    if c.proc.poll() is None:
        c.proc.send_signal(signal.SIGTERM)
    try:
        c.proc.wait(timeout=timeout_s)
        c.stopped_cleanly = True
    except subprocess.TimeoutExpired:
        c.stopped_cleanly = False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(c.proc.pid, signal.SIGKILL)
        c.proc.wait(timeout=10)
    c.up_returncode = c.proc.returncode
    # Nodes get SIGTERM from `pdserve up` (and PDEATHSIG); give stragglers a moment, then report.
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(_alive(p) for p in descendants):
        time.sleep(0.1)
    c.leftover_pids = [p for p in descendants if _alive(p)]
    for pid in c.leftover_pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    c.stop_s = time.monotonic() - t0


def start_cluster(*flags: str, log_path: str | None = None, startup_timeout_s: float = 300.0,
                  log_level: str = "WARNING", source: str | None = None) -> Cluster:
    """`pdserve up` with flags on a free loopback port, once healthy; source: another checkout's
    directory to run pdserve from (its own package first on the path: a baseline beside this one)."""
    port = free_port()
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="pdserve-up-", suffix=".log")
        os.close(fd)
    if "--model" not in flags:  # the built-in test model unless one is named (the CLI's default is SmolLM2)
        flags = ("--model", "builtin:tiny", *flags)
    cmd = [sys.executable, "-m", "pdserve", "--log-level", log_level, "up",
           "--host", "127.0.0.1", "--port", str(port), *flags]
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        env = None if source is None else dict(os.environ, PYTHONPATH=os.path.abspath(source))
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env, cwd=source)
    c = Cluster(f"http://127.0.0.1:{port}", proc, log_path, tuple(flags))
    try:
        _wait_healthy(c, startup_timeout_s)
    except BaseException:
        stop_cluster(c)
        raise
    c.startup_s = time.monotonic() - t0
    return c


@contextlib.contextmanager
def local_cluster(*flags: str, **kwargs) -> Iterator[Cluster]:
    c = start_cluster(*flags, **kwargs)
    try:
        yield c
    finally:
        stop_cluster(c)


@contextlib.contextmanager
def peer_server(name: str, cmd: list[str], port: int, log_path, timeout_s: float,
                env: dict | None = None) -> Iterator[tuple[str, int]]:
    """A peer's HTTP server (llama-server, transformers serve) on 127.0.0.1:port in a process group
    of its own, logged to log_path: yields (url, pid) once GET /health answers 200; stops the group
    (SIGTERM, then SIGKILL after 20 s) however the caller exits."""
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)
    try:
        _wait_peer_ready(name, url, proc, log_path, timeout_s)
        yield url, proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _wait_peer_ready(name: str, url: str, proc: subprocess.Popen, log_path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log_path) as f:
                raise ClusterError(f"{name} exited ({proc.returncode}):\n{f.read()[-3000:]}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        time.sleep(0.5)
    raise ClusterError(f"{name} not ready in {timeout_s:.0f} s")


def source_info() -> dict:
    """Which pdserve the benchmark ran: its path, and the git commit (+ dirty files) when the
    source is a checkout, else $PDSERVE_BENCH_COMMIT (set it when running from an exported tree)."""
    import pdserve
    root = os.path.dirname(os.path.dirname(os.path.abspath(pdserve.__file__)))
    info = {"pdserve": os.path.dirname(os.path.abspath(pdserve.__file__)),
            "commit": os.environ.get("PDSERVE_BENCH_COMMIT")}
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode == 0:
            info["commit"] = head.stdout.strip()
            status = subprocess.run(["git", "-C", root, "status", "--short", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=10)
            info["dirty"] = status.stdout.split("\n")[:-1] if status.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info
