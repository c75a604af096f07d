"""The docker compose demo, run for real: images built, Redis, two prefill nodes, two decode nodes,
the router and Prometheus each in a container, driven through the published port with the
official openai client.

Greedy output equals the offline engine's over NIXL and over the store; a prefill container
SIGKILLed under load costs no request and is restarted; Prometheus scrapes the router.

The engine: a running one if `docker info` answers; else, as root with dockerd installed, a
private one (scripts/private-dockerd.sh) stopped at the end; else the test skips, or fails when
PDSERVE_REQUIRE_DOCKER=1 (CI). Base images: PDSERVE_BASE_IMAGE and friends if set, else those
scripts/build-base-images.sh made earlier, else it builds them when it can (root, debootstrap),
else the public images.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from pdserve import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
PROJECT = f"pdstest{os.getpid()}"
BASE_IMAGES = {"PDSERVE_BASE_IMAGE": "pdserve/python-base:bookworm",
               "PDSERVE_REDIS_IMAGE": "pdserve/redis-base:bookworm",
               "PDSERVE_PROMETHEUS_IMAGE": "pdserve/prometheus-base:bookworm"}
MAX_TOKENS = 24


def prompt(salt: str, length: int) -> list[int]:
    """A fresh prompt per salt: the nodes' prefix caches hold nothing of it, so it is longer than
    the router's local-prefill threshold and goes through a prefill node and a handover."""
    rng = random.Random(salt)  # a str seed is hashed with SHA-512: the same in every process
    return [rng.randrange(10, 250) for _ in range(length)]


def _unavailable(reason: str):
    if os.environ.get("PDSERVE_REQUIRE_DOCKER") == "1":
        pytest.fail(f"PDSERVE_REQUIRE_DOCKER=1 but {reason}")
    pytest.skip(reason)


def _docker_answers(env: dict[str, str]) -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, env=env, timeout=60).returncode == 0


def _compose_cli(env: dict[str, str]) -> list[str] | None:
    """The v2 plugin if present, else Debian's docker-compose 1.29."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True, env=env).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


@contextlib.contextmanager
def docker_engine():
    """Yields the environment that reaches an engine; stops the one it started."""
    env = dict(os.environ)
    if _docker_answers(env):
        yield env
        return
    if os.geteuid() != 0 or shutil.which("dockerd") is None:
        _unavailable("no Docker engine answers, and starting one needs root and dockerd (apt-get install docker.io)")
    script = str(ROOT / "scripts" / "private-dockerd.sh")
    out = subprocess.run([script, "start"], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        _unavailable(f"the private dockerd did not start: {out.stderr[-800:]}")
    env["DOCKER_HOST"] = out.stdout.strip().split("DOCKER_HOST=", 1)[1]
    try:
        yield env
    finally:
        subprocess.run([script, "stop"], capture_output=True, timeout=120)


def _base_images(env: dict[str, str]) -> dict[str, str]:
    if all(env.get(k) for k in BASE_IMAGES):
        return {}
    have = all(subprocess.run(["docker", "image", "inspect", image], capture_output=True, env=env).returncode == 0
               for image in BASE_IMAGES.values())
    if have:
        return dict(BASE_IMAGES)
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        return {}  # the public images, from a registry
    cmd = [str(ROOT / "scripts" / "build-base-images.sh")]
    if Path(env.get("SSL_CERT_FILE", "/etc/ssl/certs/ca-certificates.crt")).is_file():
        cmd += ["--ca-bundle", env.get("SSL_CERT_FILE", "/etc/ssl/certs/ca-certificates.crt")]
    if Path(env.get("PIP_FIND_LINKS", "/nonexistent")).is_dir():
        cmd += ["--wheels", env["PIP_FIND_LINKS"]]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(BASE_IMAGES)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Demo:
    """One compose project: its CLI, environment and published ports."""

    def __init__(self, env: dict[str, str]) -> None:
        cli = _compose_cli(env)
        if cli is None:
            _unavailable("neither the docker compose plugin nor docker-compose is installed")
        self.port, self.prometheus_port = _free_port(), _free_port()
        self.env = {**env, **_base_images(env), "PDSERVE_PORT": str(self.port),
                    "PDSERVE_PROMETHEUS_PORT": str(self.prometheus_port),
                    "PDSERVE_MODEL": "builtin:tiny"}  # the image's default is SmolLM2: slower, other vocab
        self.cli = [*cli, "-p", PROJECT, "-f", str(ROOT / "compose.yaml"), "--profile", "monitoring"]
        self.url = f"http://127.0.0.1:{self.port}"

    def compose(self, *args: str, timeout: float = 900, **env: str) -> str:
        out = subprocess.run([*self.cli, *args], capture_output=True, text=True, cwd=ROOT,
                             env={**self.env, **env}, timeout=timeout)
        assert out.returncode == 0, f"compose {' '.join(args)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
        return out.stdout

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service).strip()

    def inspect(self, service: str, fmt: str) -> str:
        out = subprocess.run(["docker", "inspect", "-f", fmt, self.container(service)], capture_output=True,
                             text=True, env=self.env, timeout=60)
        return out.stdout.strip()

    def nodes(self) -> dict[str, dict]:
        return {n["id"]: n for n in httpx.get(f"{self.url}/health", timeout=5).json()["nodes"]}

    def wait_ready(self, timeout: float = 300) -> None:
        wait_for(lambda: httpx.get(f"{self.url}/health", timeout=5).status_code == 200
                 and all(n["healthy"] for n in self.nodes().values()), timeout, "every node healthy behind the router")

    def logs(self) -> str:
        out = subprocess.run([*self.cli, "logs", "--tail", "40"], capture_output=True, text=True, cwd=ROOT,
                             env=self.env, timeout=120)
        return out.stdout[-6000:]


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            if predicate():
                return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def demo():
    with docker_engine() as env:
        d = Demo(env)
        try:
            d.compose("up", "-d", "--build", timeout=1800)
            d.wait_ready()
            yield d
        except BaseException:
            print(d.logs())
            raise
        finally:
            subprocess.run([*d.cli, "down", "-v", "--remove-orphans"], capture_output=True, cwd=ROOT,
                           env=d.env, timeout=300)


@pytest.fixture(scope="module")
def offline():
    llm = LLM("builtin:tiny")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    def greedy(prompt: list[int]) -> list[int]:
        return llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
    return greedy


def client(demo: Demo) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{demo.url}/v1", api_key="none", max_retries=0, timeout=180)


def stream_ids(demo: Demo, prompt: list[int]) -> list[int]:
    ids: list[int] = []
    for chunk in client(demo).completions.create(model="builtin:tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True, "return_token_ids": True}):
        if chunk.choices:
            ids += chunk.choices[0].model_extra.get("token_ids") or []
    return ids


def check_greedy(demo: Demo, offline, salt: str) -> None:
    """Completions (streamed and not) and chat, each against the offline engine."""
    c = client(demo)
    for k in range(3):
        ids = prompt(f"{salt}-{k}", 100 + 13 * k)
        want = offline(ids)
        full = c.completions.create(model="builtin:tiny", prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
        assert full.choices[0].model_extra["token_ids"] == want
        assert stream_ids(demo, prompt(f"{salt}-stream-{k}", 90 + 7 * k)) == offline(prompt(f"{salt}-stream-{k}",
                                                                                         90 + 7 * k))
    messages = [{"role": "user", "content": f"Tell me about disaggregated serving ({salt})."}]
    rendered = httpx.post(f"{demo.url}/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
    chat = c.chat.completions.create(model="builtin:tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    assert chat.choices[0].model_extra["token_ids"] == offline(rendered)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="builtin:tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if ch.choices)
    assert streamed == chat.choices[0].message.content


def test_openai_client_over_nixl_matches_offline_engine(demo, offline):
    assert httpx.get(f"{demo.url}/health", timeout=5).json()["transfer"] == "nixl"
    models = client(demo).models.list()
    assert [m.id for m in models.data] == ["builtin:tiny"]
    # The router has no node lists: it found every node in the Redis registry, at its service name.
    want = {f"{role}-{i}": f"tcp://{role}-{i}:5600" for role in ("prefill", "decode") for i in range(2)}
    assert {n: s["address"] for n, s in demo.nodes().items()} == want
    check_greedy(demo, offline, "nixl")
    stats = demo.nodes()
    assert sum(n["transfer_bytes_nixl"] for n in stats.values()) > 0  # KV really crossed containers


def test_prometheus_scrapes_the_router(demo):
    api = f"http://127.0.0.1:{demo.prometheus_port}/api/v1"

    def router_target_up() -> bool:
        targets = httpx.get(f"{api}/targets", timeout=5).json()["data"]["activeTargets"]
        return any(t["labels"]["job"] == "pdserve-router" and t["health"] == "up" for t in targets)
    wait_for(router_target_up, 60, "Prometheus to scrape the router")

    def served_requests() -> float:
        result = httpx.get(f"{api}/query", params={"query": "sum(pdserve_requests_total)"},
                           timeout=5).json()["data"]["result"]
        return float(result[0]["value"][1]) if result else 0.0
    wait_for(lambda: served_requests() > 0, 60, "pdserve_requests_total in Prometheus")
    dashboard = json.loads((ROOT / "monitoring" / "grafana" / "pdserve-dashboard.json").read_text())
    for panel in dashboard["panels"]:  # every Grafana query is valid PromQL that Prometheus runs
        for target in panel["targets"]:
            answer = httpx.get(f"{api}/query", params={"query": target["expr"]}, timeout=10).json()
            assert answer["status"] == "success", (panel["title"], target["expr"], answer)
    names = httpx.get(f"{api}/label/__name__/values", timeout=5).json()["data"]
    for family in ("pdserve_request_ttft_seconds_bucket", "pdserve_kv_blocks_in_use",
                   "pdserve_kv_transfer_bytes_total"):
        assert family in names, f"{family} not in Prometheus: {sorted(n for n in names if n.startswith('pdserve_'))}"


def _kill_main_process(demo: Demo, service: str) -> None:
    """SIGKILL from the host, as a crash would; `docker kill` marks the container stopped by
    hand, which turns its restart policy off."""
    pid = int(demo.inspect(service, "{{.State.Pid}}"))
    if pid <= 0:
        raise AssertionError(f"{service} is not running")
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pytest.skip("the engine's containers are not in this machine's pid namespace (a remote engine)")


def test_prefill_container_killed_under_load_loses_nothing_and_restarts(demo, offline):
    prompts = [prompt(f"kill-{k}", 120 + 2 * k) for k in range(40)]
    expected = [offline(p) for p in prompts]
    assert demo.nodes()["prefill-0"]["healthy"]
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream_ids, demo, p) for p in prompts[:24]]
        time.sleep(1.0)
        _kill_main_process(demo, "prefill-0")
        futures += [pool.submit(stream_ids, demo, p) for p in prompts[24:]]  # after the kill
        try:
            outputs = [f.result(timeout=600) for f in futures]
        except Exception as exc:  # (a stream that failed: the router's log says which nodes it lost and why)
            raise AssertionError(f"{exc!r}\nthe containers' last log lines:\n{demo.logs()}") from exc
    assert outputs == expected  # no request failed, none changed
    failover = httpx.get(f"{demo.url}/health", timeout=5).json()["failover"]
    print(f"failover counters after the kill: {failover}")
    wait_for(lambda: int(demo.inspect("prefill-0", "{{.RestartCount}}")) >= 1, 60, "docker to restart prefill-0")
    wait_for(lambda: demo.inspect("prefill-0", "{{.State.Health.Status}}") == "healthy", 240,
             "the restarted prefill-0 to pass its healthcheck")
    wait_for(lambda: demo.nodes()["prefill-0"]["healthy"], 60, "prefill-0 to rejoin the rotation")
    check_greedy(demo, offline, "restarted")
    wait_for(lambda: sum(n["kv_blocks_in_use"] for n in demo.nodes().values()) == 0, 60, "KV blocks back to 0")


def test_store_handover_matches_offline_engine(demo, offline):
    # Only the router's flags change. Its threshold placement sends every fresh prompt through a
    # prefill node, and so through the store: slo's may prefill on the decode nodes when that is
    # sooner, and once did for every prompt here (a prefill node's cost estimate then carried its
    # first step's kernel load, pdserve.engine.engine._record_step_cost), with no handover to test.
    demo.compose("up", "-d", "router", PDSERVE_KV_TRANSFER="store", PDSERVE_PREFILL_PLACEMENT="threshold")
    wait_for(lambda: httpx.get(f"{demo.url}/health", timeout=5).json()["transfer"] == "store", 240,
             "the router to come back with --kv-transfer store")
    demo.wait_ready()
    check_greedy(demo, offline, "store")
    stats = demo.nodes()
    keys = ("requests_total", "transfer_bytes_store", "cached_tokens_store", "whole_requests", "prefill_ns_per_token")
    seen = {node: {k: n.get(k) for k in keys} for node, n in stats.items()}
    placed = httpx.get(f"{demo.url}/health", timeout=5).json().get("failover")
    assert sum(n["transfer_bytes_store"] for n in stats.values()) > 0, json.dumps([seen, placed])
