"""A client that closes its stream (the official openai client) at each stage of a P/D request
frees the request's KV blocks on the prefill node and on the decode node at once: while it is
queued behind another prompt, while its prompt is computing, in the handover (blocks pinned on
the prefill node, the decode node not pulling yet), and while it decodes; and a decode node
that dies before it pulls leaves no block pinned on the prefill node.

The cluster computes prompts 16 tokens a step, so a long prompt takes many steps, and each
decode node waits PULL_DELAY_S before it pulls, so a handover stays open; the NIXL lease is far
longer than any wait here, so blocks freed in time were freed by the abort, not by the lease.
After each case the same prompt, asked again in full, gives the offline engine's text.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time

import openai
import pytest

from pdserve import LLM, SamplingParams
from pdserve.testing.up_cluster import node_pids, node_stats, router_counter, running_cluster, wait_for

MODEL = "builtin:tiny"
PULL_DELAY_S = 5.0  # long enough that a loaded machine still reads the pinned blocks before the READ
LEASE_S = 300
PROMPT_BLOCKS = 25  # the handover's prompt, in blocks of the default 16 tokens
FREED_WITHIN_S = 8.0  # pongs every 0.2 s; a loaded 2-core machine delays them, never by a lease


def _prompt(stage: str, tokens: int) -> str:
    text = f"{stage}: cancellation reaches every side of the handover. "
    return (text * (tokens // len(text) + 1))[:tokens]  # the built-in tokenizer: a byte a token


@pytest.fixture(scope="module")
def cluster():
    with running_cluster("--kv-transfer", "nixl", "--prefill-nodes", "1", "--decode-nodes", "2",
                         "--num-kv-blocks", "256", "--max-num-batched-tokens", "16", "--lease-s", str(LEASE_S),
                         "--decode-pull-delay-s", str(PULL_DELAY_S)) as (url, proc):
        yield url, proc


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, num_kv_blocks=256)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _open(client: openai.OpenAI, prompt: str, max_tokens: int = 400):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True,
                                      temperature=0, extra_body={"ignore_eos": True})


def _in_use(url: str) -> dict[str, int]:
    return {name: n.get("kv_blocks_in_use", -1) for name, n in node_stats(url).items()}


def _decoding(url: str) -> int:
    return sum(v for name, v in _in_use(url).items() if name.startswith("decode"))


def _all_freed(url: str) -> None:
    started = time.monotonic()
    wait_for(lambda: all(v == 0 for v in _in_use(url).values()), timeout_s=FREED_WITHIN_S)
    assert time.monotonic() - started < LEASE_S
    stats = node_stats(url)
    assert stats["prefill-0"]["leases_expired"] == 0  # freed by the abort, never by the lease
    assert all(n["requests"] == 0 for n in stats.values())


def _aborts(url: str, stage: str | None = None) -> float:
    return router_counter(url, "pdserve_request_aborts", **({"stage": stage} if stage else {}))


def _counted(url: str, stage: str | None, before: float, n: int = 1) -> None:
    """/metrics counts the abort at the stage the request was in (stage None: at any stage; the
    tiny model may finish a prompt between the test's look and its close)."""
    with contextlib.suppress(AssertionError):
        wait_for(lambda: _aborts(url, stage) == before + n, timeout_s=FREED_WITHIN_S)
    assert _aborts(url, stage) == before + n


def _same_as_offline(url: str, llm: LLM, prompt: str) -> None:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    got = _client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text
    assert got == want


def test_closed_while_prefilling(cluster, llm):
    url, prompt = cluster[0], _prompt("prefilling", 1200)
    aborts = _aborts(url)
    stream = _open(_client(url), prompt)
    wait_for(lambda: _in_use(url)["prefill-0"] > 0, timeout_s=60)  # computing, nothing handed over
    assert _decoding(url) == 0
    stream.close()
    _all_freed(url)
    _counted(url, None, aborts)
    _same_as_offline(url, llm, prompt)


def test_closed_while_queued_behind_another_prompt(cluster, llm):
    url = cluster[0]
    client = _client(url)
    aborts = _aborts(url)
    ahead = _open(client, _prompt("ahead", 1200))
    wait_for(lambda: _in_use(url)["prefill-0"] > 0, timeout_s=60)
    queued = _open(client, _prompt("queued", 600))
    time.sleep(0.5)  # it waits for the prompt ahead of it, which has every step's 16 tokens
    queued.close()
    ahead.close()
    _all_freed(url)
    _counted(url, None, aborts, 2)
    _same_as_offline(url, llm, _prompt("queued", 600))


def test_closed_in_the_handover(cluster, llm):
    """The first token came from the prefill node; its blocks are pinned for a READ the decode
    node has not started (it waits PULL_DELAY_S): the prefill node frees them at once."""
    url, prompt = cluster[0], _prompt("handover", PROMPT_BLOCKS * 16)
    aborts = _aborts(url, "handover")
    stream = _open(_client(url), prompt)
    next(iter(stream))  # the first token: the handover is on its way to the decode node
    # Pinned for the READ. The node's stats come with its pongs (every 0.2 s), and the tiny model
    # computes the prompt faster than that: wait for a pong from after the prompt.
    wait_for(lambda: _in_use(url)["prefill-0"] >= PROMPT_BLOCKS, timeout_s=PULL_DELAY_S - 1)
    stream.close()
    freed_at = time.monotonic()
    _all_freed(url)
    assert time.monotonic() - freed_at < PULL_DELAY_S + FREED_WITHIN_S
    _counted(url, "handover", aborts)
    _same_as_offline(url, llm, prompt)


def test_closed_while_decoding(cluster, llm):
    url, prompt = cluster[0], _prompt("decoding", 200)
    aborts = _aborts(url, "decode")
    stream = _open(_client(url), prompt, max_tokens=3000)
    received = 0
    for chunk in stream:
        received += len(chunk.choices[0].text) if chunk.choices else 0
        if received >= 20:  # well past the handover: the decode node streams
            break
    assert _decoding(url) > 0
    stream.close()
    _all_freed(url)
    _counted(url, "decode", aborts)
    _same_as_offline(url, llm, prompt)


def test_a_decode_node_lost_in_the_handover_frees_the_pinned_blocks(cluster, llm):
    """The decode node dies before it pulls: the stream resumes on the other decode node, and
    the router tells the prefill node to free the blocks nobody will read, at once."""
    url, proc = cluster
    prompt = _prompt("lost decode", 400)
    stream = iter(_open(_client(url), prompt, max_tokens=24))
    text = next(stream).choices[0].text  # the handover is on its way; the decode node waits to pull

    def holder():
        return next((n for n, s in node_stats(url).items() if n.startswith("decode") and s["routed_requests"]), None)

    victim = wait_for(holder, timeout_s=PULL_DELAY_S)
    os.kill(node_pids(proc.pid)[victim], signal.SIGKILL)
    text += "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    assert text == llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    wait_for(lambda: _in_use(url)["prefill-0"] == 0, timeout_s=FREED_WITHIN_S)
    assert node_stats(url)["prefill-0"]["leases_expired"] == 0
    wait_for(lambda: node_stats(url).get(victim, {}).get("healthy"), timeout_s=120)  # restarted
    _all_freed(url)
