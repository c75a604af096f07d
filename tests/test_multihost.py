"""Three hosts on one machine: the router, a prefill node and a decode node each in its own
network namespace with its own address on a bridge, over NIXL and over the store (Redis on the
bridge). The prefill node's link is cut under load and restored: every request still completes
with the offline engine's greedy text, the node leaves the rotation, and it rejoins.

Needs root (CI runs as root); skipped with the reason where namespaces cannot be made.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import shutil
import subprocess
import sys
import time

import httpx
import openai
import pytest
from ray_util import LAB_UCX_TLS

from pdserve import LLM, SamplingParams

TAG = f"{os.getpid() % 10000:04d}"
SUBNET = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
HOSTS = {"rt": 2, "pf": 3, "dc": 4}  # namespace short name -> last octet


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    if not check and shutil.which(cmd[0]) is None:  # optional tools (iptables) may be absent
        return subprocess.CompletedProcess(cmd, 127)
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"pdprobe{TAG}"
    if _run("ip", "netns", "add", probe, check=False).returncode != 0:
        return "cannot create a network namespace here (ip netns add failed)"
    _run("ip", "netns", "del", probe, check=False)
    return None


pytestmark = pytest.mark.skipif(_netns_unavailable() is not None, reason=str(_netns_unavailable()))


def ns(name: str) -> str:
    return f"pd{name}{TAG}"


def addr(name: str) -> str:
    return f"{SUBNET}.{HOSTS[name]}"


@contextlib.contextmanager
def lab():
    """A bridge with the root namespace at .1 and one namespace per host, each on a veth pair."""
    bridge = f"pdbr{TAG}"
    for name in HOSTS:  # leftovers of a lab that was torn down uncleanly
        _run("ip", "link", "del", f"v{name}{TAG}", check=False)
        _run("ip", "netns", "del", ns(name), check=False)
    _run("ip", "link", "del", bridge, check=False)
    _run("ip", "link", "add", bridge, "type", "bridge")
    try:
        _run("ip", "addr", "add", f"{SUBNET}.1/24", "dev", bridge)
        _run("ip", "link", "set", bridge, "up")
        # Docker's FORWARD policy (DROP) also filters bridged frames when br_netfilter is loaded.
        _run("iptables", "-I", "FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT", check=False)
        for name in HOSTS:
            host_end, ns_end = f"v{name}{TAG}", f"p{name}{TAG}"
            _run("ip", "netns", "add", ns(name))
            _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", ns_end)
            _run("ip", "link", "set", ns_end, "netns", ns(name))
            _run("ip", "-n", ns(name), "addr", "add", f"{addr(name)}/24", "dev", ns_end)
            _run("ip", "-n", ns(name), "link", "set", ns_end, "up")
            _run("ip", "-n", ns(name), "link", "set", "lo", "up")
            _run("ip", "link", "set", host_end, "master", bridge)
            _run("ip", "link", "set", host_end, "up")
        yield
    finally:
        for name in HOSTS:
            # Namespaces die asynchronously in the kernel; drop the veth pairs now so the next
            # lab (same TAG, same process) can make them again.
            _run("ip", "link", "del", f"v{name}{TAG}", check=False)
            _run("ip", "netns", "del", ns(name), check=False)
        _run("iptables", "-D", "FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT", check=False)
        _run("ip", "link", "del", bridge, check=False)


def spawn(name: str, *args: str, log_dir) -> subprocess.Popen:
    # UCX over TCP, as between separate machines: shared memory would bypass the link the test cuts
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", UCX_TLS=LAB_UCX_TLS)
    log = open(log_dir / f"{name}.log", "w")
    return subprocess.Popen(["ip", "netns", "exec", ns(name), sys.executable, "-m", "pdserve", "--log-level",
                             "WARNING", *args, "--model", "builtin:tiny"], stdout=log, stderr=subprocess.STDOUT,
                            env=env,
                            start_new_session=True)


def nodes(url: str) -> dict:
    return {n["id"]: n for n in httpx.get(f"{url}/health", timeout=5).json()["nodes"]}


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if predicate():
                return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.contextmanager
def cluster(transfer: str, log_dir):
    procs, redis = [], None
    store = []
    if transfer == "store":
        redis = subprocess.Popen(["redis-server", "--port", "6399", "--bind", f"{SUBNET}.1", "--save", "",
                                  "--appendonly", "no", "--protected-mode", "no"], stdout=subprocess.DEVNULL)
        store = ["--store", f"redis://{SUBNET}.1:6399"]
    try:
        common = ["--num-kv-blocks", "512"]
        procs.append(spawn("pf", "prefill", "--node-id", "prefill-0", "--bind", f"tcp://{addr('pf')}:5600",
                           "--nixl-side-channel", f"tcp://{addr('pf')}:5601", *common, *store, log_dir=log_dir))
        procs.append(spawn("dc", "decode", "--node-id", "decode-0", "--bind", f"tcp://{addr('dc')}:5600",
                           "--kv-timeout-s", "5", *(["--nixl"] if transfer == "nixl" else []), *common, *store,
                           log_dir=log_dir))
        procs.append(spawn("rt", "router", "--host", addr("rt"), "--port", "8000", "--kv-transfer", transfer,
                           # every prompt crosses the network
                           "--local-prefill-threshold", "0", "--prefill-placement", "threshold",
                           "--prefill", f"tcp://{addr('pf')}:5600", "--decode", f"tcp://{addr('dc')}:5600",
                           log_dir=log_dir))
        url = f"http://{addr('rt')}:8000"
        wait_for(lambda: all(n["healthy"] for n in nodes(url).values()), 180, "all nodes healthy")
        yield url
    finally:
        for p in procs + ([redis] if redis else []):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, 9) if p is not redis else p.kill()
            p.wait(timeout=10)


def complete(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    ids = []
    for chunk in client.completions.create(model="builtin:tiny", prompt=prompt, max_tokens=max_tokens, stream=True,
                                           temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True}):
        if chunk.choices:
            ids += chunk.choices[0].model_extra.get("token_ids") or []
    return ids


@pytest.mark.parametrize("transfer", ["nixl", "store"])
def test_prefill_link_cut_under_load_loses_nothing_and_node_rejoins(transfer, tmp_path):
    prompts = [[(k * 29 + i * 7) % 200 + 20 for i in range(160 + 8 * k)] for k in range(12)]
    llm = LLM("builtin:tiny")
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in
                llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    with lab(), cluster(transfer, tmp_path) as url:
        assert complete(url, prompts[0], 48) == expected[0]  # the network path works before the cut
        with cf.ThreadPoolExecutor(2 * len(prompts)) as pool:
            futures = [pool.submit(complete, url, p, 48) for p in prompts]
            time.sleep(0.5)
            _run("ip", "link", "set", f"vpf{TAG}", "down")
            # A second wave after the cut: on a fast machine the first may have left prefill already.
            futures += [pool.submit(complete, url, p, 48) for p in prompts]
            outputs = [f.result(timeout=180) for f in futures]
        assert outputs == expected + expected  # nothing lost, nothing changed
        # Requests may all finish on other paths before the missed pings add up: wait for them.
        wait_for(lambda: not nodes(url)["prefill-0"]["healthy"], 10, "the cut node to leave the rotation")
        failover = httpx.get(f"{url}/health", timeout=5).json()["failover"]
        assert failover["prefill_retries"] + failover["local_prefills"] > 0  # the cut hit live prefills
        _run("ip", "link", "set", f"vpf{TAG}", "up")
        wait_for(lambda: nodes(url)["prefill-0"]["healthy"], 30, "the prefill node to rejoin")
        before = nodes(url)["prefill-0"]["requests_total"]
        assert complete(url, prompts[5], 48) == expected[5]
        wait_for(lambda: nodes(url)["prefill-0"]["requests_total"] > before, 10, "a prefill on the rejoined node")
        wait_for(lambda: nodes(url)["decode-0"]["kv_blocks_in_use"] == 0, 30, "decode blocks back to 0")
