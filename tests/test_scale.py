"""Elastic scaling on a real cluster (`pdserve up`, separate processes, real sockets, NIXL, the
official openai client with retries off): scale 1P1D -> 2P2D -> 1P1D and switch a node's role
while greedy streams run. No request fails, every output equals the offline engine's token for
token, removed nodes drain and exit, a switched node keeps its process and its prefix cache (and
its new role when its process dies and is started again), and
no KV block stays in use afterwards. Also the admin API's key and its refusals of bad input."""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from pdserve import LLM, SamplingParams
from pdserve.testing.up_cluster import node_pids, node_stats, running_cluster, wait_for

KEY = "scale-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = [f"stream {i}: " + "elastic pools keep every request. " * (1 + i % 3) for i in range(8)]
LONG = 480  # tokens per stream: long enough to outlast a scale or switch call on a fast machine


@pytest.fixture(scope="module")
def llm():
    return LLM("builtin:tiny", num_kv_blocks=512)


@pytest.fixture(scope="module")
def want(llm):
    return _reference(llm, PROMPTS, LONG)


@pytest.fixture(scope="module")
def cluster():
    with running_cluster("--kv-transfer", "nixl", "--prefill-nodes", "1", "--decode-nodes", "1",
                         "--num-kv-blocks", "512", "--api-key", KEY) as (url, proc):
        yield url, proc


def _admin(url: str, path: str, body: dict | None = None, headers=AUTH) -> httpx.Response:
    if body is None:
        return httpx.get(f"{url}{path}", headers=headers, timeout=300)
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=300)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300)


def _stream_ids(client: openai.OpenAI, prompt, max_tokens: int, on_token=None) -> list[int]:
    ids: list[int] = []
    stream = client.completions.create(model="builtin:tiny", prompt=prompt, max_tokens=max_tokens, stream=True,
                                       temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    for chunk in stream:
        if chunk.choices:
            ids += chunk.choices[0].model_extra.get("token_ids") or []
            if on_token is not None:
                on_token(len(ids))
    return ids


def _reference(llm: LLM, prompts: list[str], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _under_load(url: str, prompts: list[str], max_tokens: int, action, min_tokens: int = 8):
    """Stream every prompt at once; run `action` once each stream has its first min_tokens tokens."""
    client = _client(url)
    counts = [0] * len(prompts)
    flowing = threading.Event()

    def seen(i, n):
        counts[i] = n
        if all(c >= min_tokens for c in counts):
            flowing.set()

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(_stream_ids, client, p, max_tokens, lambda n, i=i: seen(i, n))
                   for i, p in enumerate(prompts)]
        assert flowing.wait(120), "the streams never got going"
        result = action()
        return [f.result() for f in futures], result  # a failed request raises here


def _timed(call, *args):
    """call(*args) and the monotonic time it returned at."""
    result = call(*args)
    return result, time.monotonic()


def _draining_or_gone(url: str, node_id: str) -> bool:
    node = next((n for n in _admin(url, "/admin/nodes").json()["nodes"] if n["id"] == node_id), None)
    return node is None or node["draining"]


def _blocks_back_to_zero(url: str) -> bool:
    return all(s["kv_blocks_in_use"] == 0 and s["requests"] == 0 for s in node_stats(url).values() if s["healthy"])


def test_admin_routes_need_the_key_and_refuse_bad_input(cluster):
    url, _ = cluster
    assert _admin(url, "/admin/nodes", headers={}).status_code == 401
    assert _admin(url, "/admin/scale", {"decode": 2}, headers={"Authorization": "Bearer wrong"}).status_code == 401
    nodes = _admin(url, "/admin/nodes").json()
    assert nodes["counts"] == {"prefill": 1, "decode": 1} and nodes["owned"] == {"prefill-0": "prefill",
                                                                                  "decode-0": "decode"}
    for body in ({"decode": 0}, {"prefill": -1}, {}, {"decode": "many"}, {"decode": 1, "extra": 1}):
        r = _admin(url, "/admin/scale", body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", body
    refusals = {("nope", "decode"): "no node", ("decode-0", "prefill"): "last decode node",
                ("decode-0", "decode"): "already"}
    for (node_id, role), why in refusals.items():
        r = _admin(url, "/admin/switch", {"node_id": node_id, "to_role": role})
        assert r.status_code == 400 and why in r.json()["error"]["message"]
    assert _admin(url, "/admin/switch", {"node_id": "decode-0", "to_role": "both"}).status_code == 400
    assert "/admin/scale" not in httpx.get(f"{url}/openapi.json").json()["paths"]
    # The command-line client: the node list with the key, a clear error without it.
    cli = [sys.executable, "-m", "pdserve", "scale", "--url", url]
    listed = subprocess.run(cli + ["--api-key", KEY], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and json.loads(listed.stdout)["counts"] == {"prefill": 1, "decode": 1}
    refused = subprocess.run(cli + ["--api-key", "wrong", "--decode", "3"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "Incorrect API key" in refused.stderr


def test_scale_up_and_down_under_load_loses_no_request(cluster, want):
    url, proc = cluster
    got, reply = _under_load(url, PROMPTS, LONG, lambda: _admin(url, "/admin/scale", {"prefill": 2, "decode": 2}))
    assert reply.status_code == 200, reply.text
    assert sorted(reply.json()["added"]) == ["decode-1", "prefill-1"]
    assert got == want
    stats = node_stats(url)
    assert all(s["healthy"] for s in stats.values()) and len(stats) == 4

    # Down again while every decode node streams: the removed ones drain (their streams move
    # through the failover resume path), then exit.
    moved_before = httpx.get(f"{url}/health").json()["drain"]["streams_moved"]
    def busiest_decode_node() -> dict | None:
        nodes = _admin(url, "/admin/nodes").json()["nodes"]
        busiest = max((n for n in nodes if n["role"] == "decode"), key=lambda n: n["in_flight"])
        return busiest if busiest["in_flight"] > 0 else None

    def scale_down_the_busiest():
        busiest = wait_for(busiest_decode_node, timeout_s=20, interval_s=0.05)["id"]
        with cf.ThreadPoolExecutor(1) as pool:
            scaling = pool.submit(_timed, _admin, url, "/admin/scale",
                                  {"prefill": 1, "decode": 1, "grace_s": 0, "remove": [busiest]})
            # An operator drains the same node while the scale removes it: the switch waits for
            # the scale, then must find the node gone (not drain a removed node until a timeout).
            wait_for(lambda: _draining_or_gone(url, busiest), timeout_s=20, interval_s=0.05)
            switch, switch_at = _timed(_admin, url, "/admin/switch", {"node_id": busiest, "to_role": "prefill"})
            scale, scale_at = scaling.result()
        assert switch.status_code == 400 and "no node" in switch.json()["error"]["message"], switch.text
        assert switch_at - scale_at < 10, f"the switch answered {switch_at - scale_at:.0f} s after the scale"
        return scale

    got, reply = _under_load(url, PROMPTS, LONG, scale_down_the_busiest)
    assert reply.status_code == 200, reply.text
    removed = reply.json()["removed"]
    assert len(removed) == 2
    assert got == want
    assert httpx.get(f"{url}/health").json()["drain"]["streams_moved"] > moved_before
    assert set(node_stats(url)) == {"prefill-0", "decode-0", "prefill-1", "decode-1"} - set(removed)
    wait_for(lambda: not set(removed) & set(node_pids(proc.pid)), timeout_s=30)
    wait_for(lambda: _blocks_back_to_zero(url), timeout_s=30)


def test_role_switch_keeps_process_weights_and_prefix_cache(cluster, llm, want):
    url, proc = cluster
    prefill = next(n for n, s in node_stats(url).items() if s["role"] == "prefill")
    decode = next(n for n, s in node_stats(url).items() if s["role"] == "decode")
    pid = node_pids(proc.pid)[prefill]
    # A prompt only the prefill node has seen: max_tokens=1 ends at the prefill, no handover.
    only_here = [(i * 7) % 250 + 5 for i in range(100)]
    assert _stream_ids(_client(url), only_here, 1) == _reference(llm, [{"prompt_token_ids": only_here}], 1)[0]

    got, reply = _under_load(url, PROMPTS, LONG, lambda: _admin(url, "/admin/switch",
                                                                {"node_id": prefill, "to_role": "decode"}))
    assert reply.status_code == 200, reply.text
    assert got == want
    stats = node_stats(url)[prefill]
    assert stats["role"] == "decode" and stats["role_switches"] == 1
    assert node_pids(proc.pid)[prefill] == pid  # same process: weights were not reloaded

    # No prefill node now: requests run whole on a decode node, and the prefix index sends this
    # prompt to the switched node, whose cache still holds it.
    r = _client(url).completions.create(model="builtin:tiny", prompt=only_here, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens >= 96
    # Node stats come with the router's pings: wait for the pong that counts this request.
    wait_for(lambda: node_stats(url).get(prefill, {}).get("requests_total", 0) > stats["requests_total"],
             timeout_s=30)

    # And back, while the switched node itself streams: its streams move to the other decode node.
    got, reply = _under_load(url, PROMPTS, LONG, lambda: _admin(url, "/admin/switch",
                                                                {"node_id": prefill, "to_role": "prefill"}))
    assert reply.status_code == 200, reply.text
    assert got == want
    assert node_stats(url)[prefill]["role"] == "prefill" and node_pids(proc.pid)[prefill] == pid
    assert node_stats(url)[decode]["healthy"]
    wait_for(lambda: _blocks_back_to_zero(url), timeout_s=30)


def test_a_switched_node_that_dies_comes_back_in_its_new_role(cluster, llm):
    """The launcher restarts a dead node with the command it last knew: after a switch that is
    the new role (the router tells the owner, SetNodeRole), not the one the node started in."""
    url, proc = cluster
    prefill = next(n for n, s in node_stats(url).items() if s["role"] == "prefill")
    reply = _admin(url, "/admin/switch", {"node_id": prefill, "to_role": "decode"})
    assert reply.status_code == 200, reply.text
    pid = node_pids(proc.pid)[prefill]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: node_pids(proc.pid).get(prefill, pid) != pid, timeout_s=60)
    wait_for(lambda: (s := node_stats(url).get(prefill)) is not None and s["healthy"]
             and s["requests_total"] == 0, timeout_s=120)  # its new process's first pongs
    assert node_stats(url)[prefill]["role"] == "decode"
    prompt = [(i * 11) % 250 + 5 for i in range(40)]
    assert _stream_ids(_client(url), prompt, 8) == _reference(llm, [{"prompt_token_ids": prompt}], 8)[0]
    # Back to one prefill node, as the module's cluster started.
    reply = _admin(url, "/admin/switch", {"node_id": prefill, "to_role": "prefill"})
    assert reply.status_code == 200, reply.text
    wait_for(lambda: _blocks_back_to_zero(url), timeout_s=30)
