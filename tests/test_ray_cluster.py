"""`pdserve up --ray` on a real Ray cluster of three machines on this one: a head and two workers,
each started with `ray start` inside its own network namespace with its own address.

  * the nodes are placed on both workers (the addresses they register say so), two routers
    serve, and the openai client's greedy output through either equals the offline engine's,
    with the KV crossing machines over NIXL; a scale request to a router starts a node through
    the controller, and both routers route to it;
  * a node's actor process SIGKILLed under load: every stream completes with the same tokens,
    and Ray restarts the actor, whose new node registers and rejoins both routers;
  * a worker machine lost under load (every process in its namespace SIGKILLed: raylet, workers,
    nodes): no request is lost, the output is the same, the lost nodes come back on the other
    worker and rejoin, no KV block stays in use, and the router that ran there is started again
    on the other worker;
  * the same greedy check with the KV handed over through the store (a redis-server on the head
    machine) to decode nodes at TP 2, after restarting only `pdserve up --ray --decode-tp 2` (the
    lost worker's raylet joins again): each decode node's worker process runs beside it on its
    machine, and both routers' /admin/nodes show each node's degree;
  * the address rule: every address registered, advertised or bound is loopback or a
    namespace's own, no process of the lab runs in the root namespace, and none listens on the
    machine's interface address (`hostname -I`).

Needs root for the namespaces (CI runs as root), and ray (the ray extra).
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import re
import signal
import sys
import threading
import time

import httpx
import openai
import psutil
import pytest
import redis
from ray_util import listening_sockets, machine_addresses, net_namespace, netns_unavailable, ray_cluster

from pdserve import LLM, SamplingParams
from pdserve.testing.redis_server import REDIS_SERVER
from pdserve.testing.up_cluster import assert_greedy_matches_offline, router_counter

pytest.importorskip("ray", reason="the ray extra is not installed")
pytestmark = pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable()))

HOSTS = {"head": 2, "w1": 3, "w2": 4}
CPUS = {"head": 0, "w1": 4, "w2": 4}  # nodes need a CPU each: none on the head; either worker holds all 4
PORT = 18400
PROMPTS = [list(range(5 + i, 70 + 3 * i)) for i in range(16)]
MAX_TOKENS = 24
TP_WORKER = "pdserve.executor.worker"  # a tensor-parallel node's rank 1..N-1 process (`python -m` it)


@pytest.fixture(scope="module")
def llm():
    return LLM("builtin:tiny", num_kv_blocks=512)


@pytest.fixture(scope="module")
def lab():
    with ray_cluster(HOSTS, CPUS) as lab:
        yield lab


class RayUp:
    """One `pdserve up --ray` at a time on the lab's Ray cluster: start() stops the one running
    (the Ray cluster stays up: restarting it would cost minutes of CI)."""

    def __init__(self, lab, log_dir):
        self.lab, self.log_dir, self.runs = lab, log_dir, 0
        self.proc = self.log_path = None

    def start(self, *flags: str) -> list[str]:
        """`--prefill-placement threshold` with a threshold of 0: every prompt goes to a prefill
        node, so each test hands KV across machines. The slo placement prices both sides by the
        nodes' measured step times, and on a loaded CI machine it once sent every prompt to an
        idle decode node (no handover at all)."""
        self.stop()
        self.runs += 1
        self.log_path = str(self.log_dir / f"up-{self.runs}.log")
        env = dict(os.environ, RAY_ADDRESS=f"{self.lab.addr('head')}:6379", OMP_NUM_THREADS="1")
        self.proc = self.lab.popen("head", [
            sys.executable, "-m", "pdserve", "--log-level", "INFO", "up", "--ray", "auto", "--model", "builtin:tiny",
            "--routers", "2", "--port", str(PORT), "--num-kv-blocks", "512", "--local-prefill-threshold", "0",
            "--threads-per-node", "1", "--prefill-placement", "threshold", *flags], self.log_path, env)
        return _wait_for_urls(self.proc, self.log_path)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=120)
        self.proc = None
        left = _pdserve_processes(self.lab)
        assert not left, f"pdserve processes left after `pdserve up --ray` stopped: {left}"


@pytest.fixture(scope="module")
def ray_up(lab, tmp_path_factory):
    runner = RayUp(lab, tmp_path_factory.mktemp("ray"))
    try:
        yield runner
    finally:
        runner.stop()


@pytest.fixture(scope="module")
def up(ray_up):
    urls = ray_up.start("--prefill-nodes", "1", "--decode-nodes", "2", "--kv-transfer", "nixl")
    return urls, ray_up.proc


@pytest.fixture(scope="module")
def redis_on_head(lab, tmp_path_factory):
    """The store: a redis-server on the head machine, bound to its namespace address only (so
    protected mode, which admits loopback clients only, is off: the workers are other machines)."""
    host, port = lab.addr("head"), PORT + 50
    proc = lab.popen("head", [REDIS_SERVER, "--bind", host, "--port", str(port), "--save", "", "--appendonly", "no",
                              "--protected-mode", "no"], str(tmp_path_factory.mktemp("redis") / "redis.log"))
    try:
        _wait(lambda: _redis_keys(host, port) >= 0, 30, "redis-server on the head")
        yield f"redis://{host}:{port}"
    finally:
        proc.terminate()  # `ip netns exec` execs redis-server: this pid is the server's
        proc.wait(timeout=30)


def _wait_for_urls(proc, log_path: str, timeout_s: float = 300) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = open(log_path).read()
        if (m := re.search(r"pdserve up --ray: (.*) serving", text)) is not None:
            return [u.removesuffix("/v1") for u in m.group(1).split()]
        assert proc.poll() is None, f"pdserve up --ray exited:\n{text[-5000:]}"
        time.sleep(0.5)
    raise AssertionError(f"pdserve up --ray was not ready in time:\n{open(log_path).read()[-5000:]}")


def _pdserve_processes(lab) -> dict[int, str]:
    """pid -> command line of every pdserve node, router or tensor-parallel worker process in the
    lab's namespaces."""
    out = {}
    for host in HOSTS:
        for pid in lab.pids(host):
            try:
                cmd = psutil.Process(pid).cmdline()
            except psutil.Error:
                continue
            if "pdserve" in cmd and "--registry" in cmd or TP_WORKER in cmd:
                out[pid] = " ".join(cmd)
    return out


def assert_each_tp_node_on_one_machine(lab, urls: list[str], degrees: dict[str, int]) -> None:
    """Every router shows each node's TP degree (/admin/nodes), and each node's ranks run on the
    machine its STRICT_PACK group reserved: its N - 1 workers beside its own process, in its
    machine's namespace, where the node registered its address."""
    for url in urls:
        admin = httpx.get(f"{url}/admin/nodes", timeout=10).json()
        assert {n["id"]: n["tensor_parallel_size"] for n in admin["nodes"]} == degrees
    host_of = {pid: host for host in HOSTS for pid in lab.pids(host)}
    nodes = _nodes(urls[0])
    for pid, cmd in _pdserve_processes(lab).items():
        args = cmd.split()
        if "--node-id" not in args:
            continue
        node_id = args[args.index("--node-id") + 1]
        workers = [c.pid for c in psutil.Process(pid).children() if TP_WORKER in c.cmdline()]
        assert len(workers) == degrees[node_id] - 1, f"{node_id}: workers {workers}"
        assert host_of[pid] == _host_of(nodes[node_id]["address"])
        for worker in workers:
            assert host_of.get(worker) == host_of[pid], f"{node_id}'s worker {worker} is not on {host_of[pid]}"
            assert net_namespace(worker) == net_namespace(pid)


def _redis_keys(host: str, port: int) -> int:
    with redis.Redis(host=host, port=port, socket_timeout=2) as client:
        return client.dbsize()


ADDRESS_FLAGS = ("--bind", "--nixl-side-channel", "--registry", "--owner", "--host", "--advertise-host", "--store")


def _host(address: str) -> str:
    """The host part of tcp://H:P, redis://H:P, http://H:P or a bare host."""
    rest = address.split("://", 1)[-1].rsplit("@", 1)[-1].split("/", 1)[0]
    return rest.rsplit(":", 1)[0].strip("[]") if ":" in rest else rest


def _advertised_hosts(lab, urls: list[str], log_path: str) -> dict[str, str]:
    """Every address the cluster registered, advertised or was told to bind -> where it was seen."""
    seen = {_host(u): f"router url {u}" for u in urls}
    for url in urls:
        seen |= {_host(n["address"]): f"node {node_id} in {url}/health" for node_id, n in _nodes(url).items()}
    registry = re.search(r"registry (\S+)\)", open(log_path).read())
    assert registry, "pdserve up --ray printed no registry address"
    seen[_host(registry.group(1))] = "the controller's registry"
    for pid, cmd in _pdserve_processes(lab).items():
        args = cmd.split()
        seen |= {_host(args[i + 1]): f"{flag} of pid {pid}" for i, flag in enumerate(args[:-1]) if flag in ADDRESS_FLAGS}
    return seen


def assert_addresses_stay_in_the_lab(lab, urls: list[str], log_path: str) -> None:
    """The address rule: Ray and pdserve bind to and advertise loopback or the namespaces' own
    addresses only, never the machine's interface address."""
    allowed = lab.addresses() | {"127.0.0.1", "::1"}
    machine = machine_addresses()
    bad = {host: where for host, where in _advertised_hosts(lab, urls, log_path).items() if host not in allowed}
    assert not bad, f"addresses outside the lab's namespaces and loopback: {bad}"
    root_ns = net_namespace(os.getpid())
    pids = {pid: host for host in HOSTS for pid in lab.pids(host)}
    for pid, host in pids.items():
        # A wildcard bind inside a namespace reaches only that namespace's own addresses.
        assert net_namespace(pid) not in (None, root_ns) or not psutil.pid_exists(pid), f"pid {pid} left {host}'s netns"
        for address, port in listening_sockets(pid):
            plain = address.removeprefix("::ffff:")
            assert plain in allowed | {"0.0.0.0", "::"} and plain not in machine, \
                f"pid {pid} on {host} listens on {address}:{port}"
    # Nothing of the lab runs outside it (e.g. a driver or a Ray server in the root namespace) ...
    lab_marks = (lab.tmp, f"{lab.addr('head').rsplit('.', 1)[0]}.")
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if any(m in cmd for m in lab_marks):
            assert net_namespace(proc.info["pid"]) != root_ns, f"in the root namespace: {cmd[:300]}"
    # ... and, as far as the root namespace sees, none of its processes listens on the machine's address.
    escaped = [c for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN and c.pid in pids
               and c.laddr.ip in machine]
    assert not escaped, escaped


def assert_the_kv_crossed(urls: list[str], path: str) -> None:
    """The decode nodes took the prompts' KV over `path`, and no pull failed: a failed pull is
    recomputed, which gives the same tokens (after the pull's deadline), so equal output alone
    would not show a broken handover. The counters come with the nodes' reports."""
    def moved() -> bool:
        return sum(router_counter(url, "pdserve_kv_transfer_bytes", path=path) for url in urls) > 0
    _wait(moved, 30, f"KV bytes moved over {path}")
    assert sum(router_counter(url, "pdserve_kv_transfer_failures", reason="pull_failed") for url in urls) == 0


def _nodes(url: str) -> dict[str, dict]:
    return {n["id"]: n for n in httpx.get(f"{url}/health", timeout=5).json()["nodes"]}


def _host_of(address: str) -> str:
    ip = address.split("://")[1].rsplit(":", 1)[0]
    return next(name for name, octet in HOSTS.items() if ip.endswith(f".{octet}"))


def _wait(predicate, timeout_s: float, what: str, state=None):
    """predicate's first truthy value within timeout_s; on timeout, fail with state() (what
    was seen instead) when given."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if value := predicate():
                return value
        except (httpx.HTTPError, KeyError, redis.RedisError):
            pass
        time.sleep(0.3)
    seen = ""
    if state is not None:
        try:
            seen = f"; seen: {state()}"
        except (httpx.HTTPError, KeyError, redis.RedisError) as e:
            seen = f"; state unavailable: {e!r}"
    raise AssertionError(f"timed out waiting for {what}{seen}")


def _all_back(urls: list[str], count: int, hosts: set[str] | None = None) -> bool:
    for url in urls:
        nodes = _nodes(url)
        if len(nodes) != count or not all(n["healthy"] for n in nodes.values()):
            return False
        if hosts is not None and {_host_of(n["address"]) for n in nodes.values()} - hosts:
            return False
    return True


def _offline(llm) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _stream(url: str, prompt: list[int], started: threading.Event) -> list[int]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=180)
    ids: list[int] = []
    stream = client.completions.create(model="builtin:tiny", prompt=prompt, max_tokens=MAX_TOKENS, stream=True,
                                       temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    for chunk in stream:
        if chunk.choices:
            ids += chunk.choices[0].model_extra.get("token_ids") or []
            if len(ids) >= 4:
                started.set()
    return ids


def _under_load(urls: list[str], llm, fault) -> None:
    """16 streams spread over `urls`; `fault()` runs once several have tokens; every stream must
    complete with the offline engine's tokens."""
    want = _offline(llm)
    started = threading.Event()
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(_stream, urls[i % len(urls)], p, started) for i, p in enumerate(PROMPTS)]
        assert started.wait(120), "no stream started"
        fault()
        got = [f.result(timeout=300) for f in futures]
    assert got == want


def test_nodes_on_both_workers_and_greedy_matches_offline(up, ray_up, lab, llm):
    urls, _ = up
    assert len(urls) == 2
    assert_addresses_stay_in_the_lab(lab, urls, ray_up.log_path)
    nodes = _nodes(urls[0])
    assert {n["role"] for n in nodes.values()} == {"prefill", "decode"} and len(nodes) == 3
    assert {_host_of(n["address"]) for n in nodes.values()} == {"w1", "w2"}, nodes
    for url in urls:
        assert _nodes(url).keys() == nodes.keys()
        for prompt in PROMPTS[:2]:
            assert_greedy_matches_offline(url, llm, prompt, 16)
    metrics = httpx.get(f"{urls[0]}/metrics", timeout=5).text
    assert re.search(r'pdserve_kv_handovers_total\{path="nixl"\} [1-9]', metrics), "no handover over NIXL"
    assert_the_kv_crossed(urls, "nixl")
    # Scaling goes through the controller (the routers' --owner): a second prefill node.
    reply = httpx.post(f"{urls[1]}/admin/scale", json={"prefill": 2}, timeout=180)
    assert reply.status_code == 200, reply.text
    _wait(lambda: _all_back(urls, 4), 180, "the new prefill node in both routers",
          state=lambda: {u: _nodes(u) for u in urls})
    assert "prefill-1" in _nodes(urls[0])


def test_a_killed_node_actor_comes_back_under_load(up, lab, llm):
    urls, _ = up
    before = _nodes(urls[0])["decode-0"]
    node_pid = next(pid for pid, cmd in _pdserve_processes(lab).items() if "--node-id decode-0" in cmd)
    actor_pid = psutil.Process(node_pid).ppid()
    _under_load(urls, llm, lambda: os.kill(actor_pid, signal.SIGKILL))
    _wait(lambda: all((n := _nodes(u).get("decode-0")) and n["healthy"] and n["address"] != before["address"]
                      for u in urls), 180, "decode-0 to rejoin both routers from its new process",
          state=lambda: {u: _nodes(u).get("decode-0") for u in urls} | {"before": before})
    assert not psutil.pid_exists(node_pid) or psutil.Process(node_pid).status() == psutil.STATUS_ZOMBIE


def test_a_lost_worker_under_load(up, lab, llm):
    urls, _ = up
    hosts = {node_id: _host_of(n["address"]) for node_id, n in _nodes(urls[0]).items()}
    router_hosts = {u: _host_of(u.replace("http://", "tcp://")) for u in urls}
    assert len(set(router_hosts.values())) == 2, f"the routers were not spread: {router_hosts}"
    other = {"w1": "w2", "w2": "w1"}
    # Lose a worker that runs nodes while the other still runs a decode node: with every decode
    # node gone at once, requests would wait for Ray's restarts instead.
    victim = next(w for w in ("w2", "w1") if w in hosts.values()
                  and any(h == other[w] and n.startswith("decode") for n, h in hosts.items()))
    survivor = other[victim]
    # Clients of a router on the lost machine lose their streams; these go through the others.
    live = [u for u, host in router_hosts.items() if host != victim]
    _under_load(live, llm, lambda: lab.kill_host(victim))
    _wait(lambda: _all_back(live, 4, {survivor}), 240, f"every node back on {survivor}",
          state=lambda: {u: _nodes(u) for u in live})
    _wait(lambda: all(n["kv_blocks_in_use"] == 0 and n["requests"] == 0 for n in _nodes(live[0]).values()),
          30, "KV blocks in use back to 0")
    # The router that ran on the lost machine is started again on the survivor and serves.
    routers = _wait(lambda: len(r := _router_urls(lab, survivor)) == 2 and r, 120, f"both routers on {survivor}")
    _wait(lambda: _all_back(routers, 4, {survivor}), 120, "the replaced router to see every node",
          state=lambda: {u: _nodes(u) for u in routers})


def _router_urls(lab, host: str) -> list[str]:
    urls = []
    for pid in lab.pids(host):
        try:
            cmd = psutil.Process(pid).cmdline()
        except psutil.Error:
            continue
        if "pdserve" in cmd and "router" in cmd and "--registry" in cmd:
            urls.append(f"http://{cmd[cmd.index('--host') + 1]}:{cmd[cmd.index('--port') + 1]}")
    return sorted(urls)


def test_greedy_over_the_store_matches_offline(ray_up, lab, llm, redis_on_head):
    """`pdserve up --ray` again on the same Ray cluster, now handing KV over through a
    redis-server on the head machine, to decode nodes at TP 2 (`--decode-tp 2`): each decode
    node's two ranks are gang-placed on one machine; prefill on one worker, decode on the other."""
    ray_up.stop()
    for worker in ("w1", "w2"):  # the machine the previous test lost joins again
        if not lab.pids(worker):
            lab.ray_started(lab.ray_start(worker, "head", CPUS[worker]))
    urls = ray_up.start("--prefill-nodes", "1", "--decode-nodes", "2", "--kv-transfer", "store",
                        "--store", redis_on_head, "--decode-tp", "2")
    nodes = _nodes(urls[0])
    # 5 CPUs (1 prefill, 2 + 2 decode ranks) fit on no single 4-CPU worker: both are used.
    assert {_host_of(n["address"]) for n in nodes.values()} == {"w1", "w2"}, nodes
    assert_each_tp_node_on_one_machine(lab, urls, {"prefill-0": 1, "decode-0": 2, "decode-1": 2})
    assert_addresses_stay_in_the_lab(lab, urls, ray_up.log_path)
    for url in urls:
        for prompt in PROMPTS[2:4]:
            assert_greedy_matches_offline(url, llm, prompt, 16)
    metrics = "".join(httpx.get(f"{url}/metrics", timeout=5).text for url in urls)
    assert re.search(r'pdserve_kv_handovers_total\{path="store"\} [1-9]', metrics), "no handover through the store"
    assert not re.search(r'pdserve_kv_handovers_total\{path="nixl"\} [1-9]', metrics)
    assert_the_kv_crossed(urls, "store")
    host, port = _host(redis_on_head), int(redis_on_head.rsplit(":", 1)[1])
    assert _redis_keys(host, port) > 0, "no KV block reached the redis-server on the head"
