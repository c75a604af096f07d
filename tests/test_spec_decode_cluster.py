"""`pdserve up` with speculative decoding on the decode nodes, over NIXL and through the store.

Each cluster has one prefill node and two decode nodes that speculate differently (a JSON list
of configs): decode-0 drafts by n-gram lookup, decode-1 with a draft model, builtin:tiny drafting
for itself. Decode nodes are picked round robin, so each method serves requests whose prompt KV
came from the prefill node. The self-draft agrees with the target at every token only if its own
KV (which the decode node recomputes over the prompt, and over the relayed tokens after a
failover) is right: its acceptance must stay 1.0. On builtin:tiny the n-gram lookup drafts often
and is seldom right, so its node exercises rejection. Against the offline engine without
speculation:
- greedy output is token-identical, whole and streamed, and every KV block is back in the
  pools of every node afterwards (the draft model's own pool too: its node reports it);
- the speculation counters reach the router's /metrics under vLLM's names, and move;
- a decode node SIGKILLed in the middle of a speculating stream: the stream resumes on the other
  decode node with identical output (greedy over NIXL onto the draft model, seeded sampling
  through the store onto the n-gram node), the router counts the resume, the stream beside it on
  the other node is untouched, the node restarts, and every process stops with the cluster.
A third cluster, started beside them (1P1D through the store), drafts with an EAGLE head, which on
the decode node drafts over the positions that node computed (the prompt's hidden states stay on
the prefill node): its output is equal too.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from spec_heads import make_eagle_head

from pdserve import LLM, SamplingParams
from pdserve.entrypoints.node_speculation import node_speculative_config
from pdserve.models.builtin import ensure_builtin_model
from pdserve.testing.up_cluster import KILL_PACE, node_pids, node_stats, running_clusters, wait_for
from pdserve.wire.transport import free_port

TRANSPORTS = ("store", "nixl")
PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog. " * 3, "0123456789" * 4,
           "speculation across the handover, " * 2]
MAX_TOKENS = 24
LONG = 300  # with KILL_PACE, long enough that a kill after token 20 lands mid-stream, with several tokens a step
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SELF_DRAFT = {"method": "draft_model", "model": "builtin:tiny", "num_speculative_tokens": 3}
# A node's /health counter -> the router's /metrics series (vLLM's names; per position: position 0's)
SPEC_METRICS = {"spec_num_drafts": "pdserve_spec_decode_num_drafts_total",
                "spec_num_draft_tokens": "pdserve_spec_decode_num_draft_tokens_total",
                "spec_num_accepted_tokens": "pdserve_spec_decode_num_accepted_tokens_total",
                "spec_accepted_pos_0": "pdserve_spec_decode_num_accepted_tokens_per_pos_total"}


@pytest.fixture(scope="module")
def llm():
    return LLM("builtin:tiny", num_kv_blocks=256)


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    """One cluster per transport and the EAGLE cluster, started side by side. Yields transport
    (or "eagle") -> (url, up process)."""
    specs = json.dumps([NGRAM, SELF_DRAFT])
    flags = [("--kv-transfer", t, "--decode-nodes", "2", "--decode-policy", "round_robin",
              "--num-kv-blocks", "256", "--speculative-config", specs, *KILL_PACE) for t in TRANSPORTS]
    head = make_eagle_head(tmp_path_factory.mktemp("eagle"), ensure_builtin_model("builtin:tiny"), seed=5)
    eagle = {"method": "eagle", "model": str(head), "num_speculative_tokens": 3}
    flags.append(("--kv-transfer", "store", "--speculative-config", json.dumps(eagle)))
    with running_clusters(*flags) as started:
        yield dict(zip((*TRANSPORTS, "eagle"), started))


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _reference(llm: LLM, prompts: list[str], max_tokens: int, **sampling) -> list:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _complete(client: openai.OpenAI, prompt: str) -> tuple[list[int], str]:
    r = client.completions.create(model="builtin:tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    return r.choices[0].model_extra["token_ids"], r.choices[0].text


def _stream(client: openai.OpenAI, prompt: str, max_tokens: int, on_token=None, **sampling) -> tuple[list[int], str]:
    ids, text = [], ""
    stream = client.completions.create(model="builtin:tiny", prompt=prompt, max_tokens=max_tokens, stream=True,
                                       extra_body={"ignore_eos": True, "return_token_ids": True}, **sampling)
    for chunk in stream:
        if chunk.choices:
            ids += chunk.choices[0].model_extra.get("token_ids") or []
            text += chunk.choices[0].text
            if on_token is not None:
                on_token(len(ids))
    return ids, text


def _spec_metrics(url: str) -> dict[tuple[str, str], float]:
    """(metric sample name, node) -> value, for the router's pdserve_spec_decode_* series at position 0
    or without a position."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text):
        for s in family.samples:
            if s.name.startswith("pdserve_spec_decode_") and s.labels.get("position", "0") == "0":
                out[(s.name, s.labels["node"])] = s.value
    return out


def _failover(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=5).json()["failover"]


def _blocks_back_to_zero(url: str) -> bool:
    """Every healthy node's pool is whole again, and a draft model's own pool empty."""
    return all(s["free_blocks"] == s["total_blocks"] and s["requests"] == 0 and not s.get("spec_draft_blocks_in_use")
               for s in node_stats(url).values() if s["healthy"])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_speculating_decode_nodes_match_offline(clusters, llm, transport):
    url, _ = clusters[transport]
    want = dict(zip(PROMPTS, _reference(llm, PROMPTS, MAX_TOKENS, temperature=0)))
    before = _spec_metrics(url)
    client = _client(url)
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:  # round robin: two prompts on each decode node
        whole = dict(zip(PROMPTS, pool.map(lambda p: _complete(client, p), PROMPTS)))
    streamed = {p: _stream(client, p, MAX_TOKENS, temperature=0) for p in PROMPTS[1:3]}  # one on each
    for prompt, (ids, text) in [*whole.items(), *streamed.items()]:
        assert ids == want[prompt].token_ids and text == want[prompt].text, prompt
    decode = [n for n, s in node_stats(url).items() if s["role"] == "decode"]
    wait_for(lambda: sum(node_stats(url)[n]["transfers_ok"] for n in decode) >= len(PROMPTS) + len(streamed))
    wait_for(lambda: _blocks_back_to_zero(url))
    # Both methods drafted for handed-over requests, and the router's /metrics shows what each did.
    stats = node_stats(url)
    after = _spec_metrics(url)
    ngram, draft = stats["decode-0"], stats["decode-1"]
    assert ngram["spec_num_drafts"] > 0 and ngram["spec_num_accepted_tokens"] <= ngram["spec_num_draft_tokens"]
    assert draft["spec_num_accepted_tokens"] == draft["spec_num_draft_tokens"] > 0
    assert draft["spec_draft_blocks_in_use"] == 0  # (reported: the pool check above covers it)
    for node in decode:
        for key, name in SPEC_METRICS.items():
            assert after[(name, node)] == stats[node][key], (name, node)
            if node == "decode-1" or "accepted" not in key:  # (n-gram drafts here are seldom right)
                assert after[(name, node)] > before.get((name, node), 0), (name, node)


@pytest.mark.parametrize("transport, sampling, victim", [
    ("nixl", {"temperature": 0}, "decode-0"),  # the n-gram node dies; the self-draft takes over
    ("store", {"temperature": 1.0, "top_p": 0.9, "seed": 11}, "decode-1"),  # the draft model's node dies
], ids=["nixl-greedy", "store-seeded"])
def test_decode_node_killed_mid_speculating_stream_resumes_identically(clusters, llm, transport, sampling, victim):
    url, proc = clusters[transport]
    prompts = ["a long speculative stream that outlives its decode node " * 2, "and a second one beside it"]
    want = [o.token_ids for o in _reference(llm, prompts, LONG, **sampling)]
    killed: list[int] = []  # the streams the victim served when it was killed
    lock = threading.Lock()

    def kill_victim(n_tokens: int) -> None:
        # Either stream's 20th token: the victim's own stream is then mid-way, whichever it is.
        with lock:
            if n_tokens < 20 or killed:
                return
            # The router's own count: a node's pong may still show a request an earlier test ended.
            serving = node_stats(url)[victim]["routed_requests"]
            if serving:
                killed.append(serving)
                os.kill(node_pids(proc.pid)[victim], signal.SIGKILL)

    old = node_pids(proc.pid)
    resumes = _failover(url)["decode_resumes"]
    drafted = node_stats(url)["decode-1"]["spec_num_draft_tokens"]
    client = _client(url)
    with cf.ThreadPoolExecutor(2) as pool:  # round robin: one stream on each decode node
        futures = [pool.submit(_stream, client, prompts[0], LONG, kill_victim, **sampling),
                   pool.submit(_stream, client, prompts[1], LONG, kill_victim, **sampling)]
        got = [f.result()[0] for f in futures]  # a lost request raises here
    assert killed, f"the streams ended before {victim} could be killed"
    assert got == want  # no repeated, missing or different token, drafts or not
    assert _failover(url)["decode_resumes"] == resumes + killed[0]
    if victim == "decode-0":  # the resumed greedy stream drafted on decode-1, every draft right
        # Its counters ride on its pongs: wait for the pong sent after both streams ended.
        decode1 = wait_for(lambda: (s := node_stats(url)["decode-1"])["routed_requests"] == 0
                           and s["running"] == 0 and s["spec_num_draft_tokens"] > drafted and s)
        assert decode1["spec_num_accepted_tokens"] == decode1["spec_num_draft_tokens"] > drafted
    wait_for(lambda: node_pids(proc.pid).get(victim, old[victim]) != old[victim], timeout_s=30)
    wait_for(lambda: node_stats(url).get(victim, {}).get("healthy"), timeout_s=120)
    wait_for(lambda: _blocks_back_to_zero(url), timeout_s=30)


def test_per_node_speculative_configs():
    """A JSON list gives the decode nodes their configs in turn (null: none); `pdserve up` refuses a
    bad entry before it starts any node."""
    specs = json.dumps([NGRAM, None])
    assert [node_speculative_config(specs, i) for i in range(3)] == [json.dumps(NGRAM), None, json.dumps(NGRAM)]
    assert node_speculative_config(json.dumps(NGRAM), 5) == json.dumps(NGRAM)
    bad = json.dumps([NGRAM, {"method": "medusa", "num_speculative_tokens": 2}])
    done = subprocess.run([sys.executable, "-m", "pdserve", "up", "--model", "builtin:tiny", "--port", str(free_port()),
                           "--speculative-config", bad], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "unknown method 'medusa'" in done.stderr + done.stdout


def test_eagle_decode_node_matches_offline(clusters, llm):
    url, _ = clusters["eagle"]
    want = dict(zip(PROMPTS, _reference(llm, PROMPTS, MAX_TOKENS, temperature=0)))
    client = _client(url)
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = dict(zip(PROMPTS, pool.map(lambda p: _complete(client, p), PROMPTS)))
    for prompt, (ids, text) in results.items():
        assert ids == want[prompt].token_ids and text == want[prompt].text
    wait_for(lambda: _blocks_back_to_zero(url))
    # Pong stats lag by up to a ping interval: wait for the ones that count these requests.
    wait_for(lambda: node_stats(url)["decode-0"]["transfers_ok"] >= len(PROMPTS)
             and node_stats(url)["decode-0"]["spec_num_draft_tokens"] > 0)
