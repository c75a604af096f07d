"""Start a real `pdserve up` cluster (separate OS processes over real sockets) for tests."""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from pdserve.protocol.sampling_params import SamplingParams
from pdserve.wire.transport import free_port


@contextlib.contextmanager
def running_cluster(*flags: str, timeout_s: float = 240.0, as_given: bool = False, command: str = "up"):
    """as_given: `pdserve up` with exactly these flags (and --port), none of the test defaults below.
    command: serve runs `pdserve serve` instead (give MODEL among the flags); with --ssl-certfile
    the URL is https (health polled without verifying the certificate)."""
    wait_for_memory()
    port = free_port()
    if not as_given:
        flags = _test_defaults(flags)
    cmd = [sys.executable, "-m", "pdserve", "--log-level", "WARNING", command, "--port", str(port), *flags]
    # Output goes to a file, not a pipe: a pipe nobody reads would block a chatty cluster.
    log_file = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    proc.log_file = log_file
    url = f"{'https' if '--ssl-certfile' in flags else 'http'}://127.0.0.1:{port}"
    children: dict[str, int] = {}
    try:
        _wait_healthy(proc, url, timeout_s)
        children = node_pids(proc.pid)
        yield url, proc
    finally:
        if proc.poll() is None:
            # Nodes the launcher restarted after a test killed one must stop too.
            children.update({f"{name} (pid {pid})": pid for name, pid in node_pids(proc.pid).items()})
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            stacks = _stacks_and_log(proc)
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"pdserve up did not stop on SIGTERM; its stacks and log:\n{stacks}") from None
        _assert_all_stopped(children)


def _stacks_and_log(proc: subprocess.Popen, tail_chars: int = 20000) -> str:
    """What a launcher that will not stop is doing: SIGUSR1 makes it print every thread's stack
    (pdserve/__main__.py registers faulthandler), then the tail of its log."""
    with contextlib.suppress(OSError):
        os.kill(proc.pid, signal.SIGUSR1)
    time.sleep(2)
    return cluster_log(proc, tail_chars)


def cluster_log(proc: subprocess.Popen, tail_chars: int = 20000) -> str:
    """The tail of a running_cluster's log (its nodes' warnings: the clusters log at WARNING), for
    a test's failure message: the file is temporary and gone once the cluster stops."""
    log_file = proc.log_file
    log_file.flush()
    log_file.seek(0)
    return log_file.read()[-tail_chars:]


@contextlib.contextmanager
def running_clusters(*flag_sets: tuple[str, ...], timeout_s: float = 240.0):
    """Several clusters side by side, started and stopped in parallel: a cluster's start and stop
    hold waits (health polls, pings, LMCache's close) that the other's work fills, so two take
    much less than twice one on 2 cores. Yields one (url, proc) per flag set."""
    managers = [running_cluster(*flags, timeout_s=timeout_s) for flags in flag_sets]
    with cf.ThreadPoolExecutor(len(managers)) as pool:
        starts = [pool.submit(m.__enter__) for m in managers]
        cf.wait(starts)
        started = [m for m, f in zip(managers, starts) if f.exception() is None]
        try:
            yield [f.result() for f in starts]  # the first failed start raises here
        finally:
            stops = [pool.submit(m.__exit__, None, None, None) for m in started]
            for f in stops:
                f.result()


MIN_AVAILABLE_GB = 5.0  # what a cluster start waits for (the suite's heaviest take 3-4 GB)
MEMORY_WAIT_S = 180.0


def wait_for_memory(min_gb: float = MIN_AVAILABLE_GB, wait_s: float = MEMORY_WAIT_S) -> None:
    """Wait, up to wait_s, until the machine has min_gb available: with the suite on two workers
    (pytest-xdist) the other worker's clusters may hold most of it, and a start into too little
    memory has the kernel kill a worker. Past wait_s the start goes ahead."""
    import psutil  # the test extra's: this module runs under the tests and benchmarks only

    deadline = time.monotonic() + wait_s
    while psutil.virtual_memory().available < min_gb * 2**30 and time.monotonic() < deadline:
        time.sleep(1.0)


def _test_defaults(flags: tuple[str, ...]) -> tuple[str, ...]:
    if "--local-prefill-threshold" not in flags:
        # Tests and benchmarks exercise the prefill nodes with short prompts, which the default
        # threshold would prefill on the decode node; they opt in to it where they test it.
        flags = ("--local-prefill-threshold", "0", *flags)
    if "--prefill-placement" not in flags:
        # The same reason: the default (slo) may prefill a prompt on the decode node when that is
        # faster; tests of the handover need it to go to the prefill node every time.
        flags = ("--prefill-placement", "threshold", *flags)
    if "--kv-cache-memory-gb" not in flags and "--num-kv-blocks" not in flags:
        # The pool the tests were written for; the default (a share of the machine's memory,
        # pdserve.engine.kv_pool_size) is tested on its own. Faulted in as used, as the default
        # pool is: written at start, each node of each cluster would pay 0.5 GB of first writes.
        flags = ("--kv-cache-memory-gb", "0.5", *flags)
        if "--kv-cache-prefault" not in flags:
            flags = ("--no-kv-cache-prefault", *flags)
    if "--model" not in flags:  # the built-in test model unless a test names one (the CLI's default is SmolLM2)
        flags = ("--model", "builtin:tiny", *flags)
    return flags


def _assert_all_stopped(children: dict[str, int]) -> None:
    """`pdserve up` stops every process it started: router, nodes and its redis-server."""
    import psutil  # optional dependency: psutil (the pdserve[test] extra)
    alive = {name: pid for name, pid in children.items()
             if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE}
    assert not alive, f"left running after pdserve up stopped: {alive}"


def _wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            proc.log_file.seek(0)
            raise AssertionError(f"pdserve up exited early:\n{proc.log_file.read()[-5000:]}")
        try:
            resp = httpx.get(f"{url}/health", timeout=2, verify=False)  # our own router, maybe self-signed
            if resp.status_code == 200 and all(n["healthy"] for n in resp.json()["nodes"]):
                return
        except httpx.HTTPError:
            pass
        # The router marks a node healthy at its first pong (pings every 0.2 s): a short poll finds
        # it there, where a half-second one waited 0.25 s on average (about 40 s over the suite).
        time.sleep(0.1)
    try:
        nodes = httpx.get(f"{url}/health", timeout=2, verify=False).json().get("nodes")
    except (httpx.HTTPError, ValueError):
        nodes = "no answer"
    raise AssertionError(f"cluster never became healthy; its nodes: {nodes}; its stacks and log:\n"
                         f"{_stacks_and_log(proc)}")


def node_stats(url: str) -> dict[str, dict]:
    return {n["id"]: n for n in httpx.get(f"{url}/health", timeout=5).json()["nodes"]}


def router_counter(url: str, name: str, **labels: str) -> float:
    """The router's /metrics counter `name` (without _total), summed over the series whose labels
    include `labels`; 0 when there is none yet."""
    from prometheus_client.parser import text_string_to_metric_families  # deferred: only tests read /metrics
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == f"{name}_total" and labels.items() <= sample.labels.items():
                total += sample.value
    return total


def node_pids(up_pid: int) -> dict[str, int]:
    """Node id (or 'router', 'redis') -> pid, read from the children's command lines."""
    import psutil  # optional dependency: psutil (the pdserve[test] extra)
    out = {}
    for child in psutil.Process(up_pid).children():
        try:
            cmd = child.cmdline()
        except psutil.Error:  # a killed node not yet reaped (a zombie), or already gone
            continue
        if "--node-id" in cmd:
            out[cmd[cmd.index("--node-id") + 1]] = child.pid
        elif "router" in cmd:
            out["router"] = child.pid
        elif cmd and "redis-server" in cmd[0]:
            out["redis"] = child.pid
    return out


# A cluster whose tests kill a node mid-stream: every step pauses 10 ms, so a tiny model's few
# hundred tokens take seconds. At full speed a stream's last token could leave the node before the
# client, lagging on a loaded CI machine, had read its 20th, and the kill found nothing streaming.
KILL_PACE = ("--node-step-delay-ms", "10")


class DecodeNodeKiller:
    """A stream's on_token callback: once the stream has `after` tokens, SIGKILL the decode node
    serving it (the first the router counts a request on); `killed` names it."""

    def __init__(self, url: str, up_pid: int, after: int = 20):
        self.url, self.up_pid, self.after = url, up_pid, after
        self.killed: list[str] = []

    def __call__(self, n_tokens: int) -> None:
        if n_tokens < self.after or self.killed:
            return
        # The router's own count: a node's pong may still show a request an earlier test ended.
        busy = [n for n, s in node_stats(self.url).items() if s["role"] == "decode" and s["routed_requests"]]
        if busy:
            self.killed.append(busy[0])
            os.kill(node_pids(self.up_pid)[busy[0]], signal.SIGKILL)


def wait_for(predicate, timeout_s: float = 20.0, interval_s: float | None = None):
    """predicate()'s first true value, polled every interval_s until timeout_s. By default every
    0.05 s for the first second, then every 0.2 s: most waits are for a node counter that its next
    pong brings (pongs every 0.2 s), which a 0.2 s poll found 0.1 s late on average, and a long wait
    (a node restarting) is not polled 20 times a second while it starts."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s or (0.05 if time.monotonic() - start < 1.0 else 0.2))
    raise AssertionError("condition not met in time")


def assert_greedy_matches_offline(url: str, llm, prompt: list[int], max_tokens: int) -> None:
    """One greedy completion through the cluster (official openai client) equals the offline
    engine's, token for token."""
    import openai  # optional dependency: openai (the pdserve[test] extra)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    r = client.completions.create(model="builtin:tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    want = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert r.choices[0].model_extra["token_ids"] == want


def decode_stats_after(url: str, pulls: int) -> list[dict] | None:
    """The decode nodes' stats once they have finished `pulls` handovers between them (landed or
    failed), else None (for wait_for)."""
    nodes = [s for s in node_stats(url).values() if s["role"] == "decode"]
    return nodes if sum(s["transfers_ok"] + s["transfers_failed"] for s in nodes) >= pulls else None
