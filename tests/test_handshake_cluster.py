"""The compatibility handshake on real processes: a router given a prefill node and two decode
nodes, one of which runs another block size, refuses that one (a clear reason in /health and
the log) and serves every request on the pair that agrees, with the offline engine's text."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import openai
import pytest

from pdserve import LLM, SamplingParams
from pdserve.wire.transport import free_port

MODEL = "builtin:tiny"
PROMPTS = [f"handshake {i}: the nodes agree on their KV. " * (1 + i % 3) for i in range(6)]


def _spawn(args: list[str], log) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "pdserve", "--log-level", "INFO", *args], stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _node(role: str, node_id: str, log, *flags: str) -> tuple[subprocess.Popen, str]:
    bind = f"tcp://127.0.0.1:{free_port()}"
    nixl = ["--nixl-side-channel", f"tcp://127.0.0.1:{free_port()}"] + (["--nixl"] if role == "decode" else [])
    proc = _spawn([role, "--model", MODEL, "--node-id", node_id, "--bind", bind, "--num-kv-blocks", "256",
                   *nixl, *flags], log)
    return proc, bind


@contextlib.contextmanager
def _mismatched_cluster():
    """prefill-0 and decode-0 at block size 16, decode-1 at 32; the router expects 16."""
    log = tempfile.TemporaryFile(mode="w+")
    procs: list[subprocess.Popen] = []
    try:
        prefill, p_addr = _node("prefill", "prefill-0", log)
        good, d0 = _node("decode", "decode-0", log)
        odd, d1 = _node("decode", "decode-1", log, "--block-size", "32")
        procs += [prefill, good, odd]
        port = free_port()
        procs.append(_spawn(["router", "--model", MODEL, "--port", str(port), "--prefill", p_addr, "--decode", d0,
                             "--decode", d1, "--kv-transfer", "nixl", "--local-prefill-threshold", "0",
                             "--prefill-placement", "threshold"], log))
        yield f"http://127.0.0.1:{port}", log
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _nodes(url: str) -> dict[str, dict]:
    try:
        return {n["id"]: n for n in httpx.get(f"{url}/health", timeout=2).json()["nodes"]}
    except (httpx.HTTPError, ValueError, KeyError):
        return {}


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.timeout(300)
def test_the_router_refuses_a_decode_node_of_another_block_size():
    llm = LLM(MODEL, num_kv_blocks=256)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    with _mismatched_cluster() as (url, log):
        def settled():
            nodes = _nodes(url)
            ok = nodes and nodes["prefill-0"]["healthy"] and nodes["decode-0"]["healthy"]
            return nodes if ok and "refused" in nodes.get("decode-1", {}) else None

        nodes = _wait(settled, 180, "prefill-0 and decode-0 healthy, decode-1 refused")
        assert not nodes["decode-1"]["healthy"]
        assert "block size: 32" in nodes["decode-1"]["refused"], nodes["decode-1"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        got = [client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]
        assert got == want
        assert "refused" in _nodes(url)["decode-1"]
        log.seek(0)
        assert "decode-1 (tcp" in log.read()  # the router's error names the node and the reason
