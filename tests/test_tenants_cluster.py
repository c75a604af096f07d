"""Tenant and adapter isolation through a real `pdserve up` cluster: two prefill nodes (round
robin, so a request and its repeat land on different nodes), one decode node, the KV store on a
real redis-server (pdserve/testing/redis_server.py, direct Redis so its keys can be read back), and two LoRA
adapters of builtin:tiny made with PEFT.

Tenants come from API keys (`--api-key KEY:TENANT`), from the x-tenant-id header, and mix with
the body's cache_salt. A tenant's repeat finds its prompt in the store from the other prefill
node; another tenant's identical prompt finds nothing anywhere (cached_tokens 0) and takes as long
as a cold prompt, so its timing says nothing about what others sent (CVE-2025-46570).

Adapters: greedy tokens equal PEFT's PeftModel.generate with the KV handed over through the store;
the same prompt under another adapter finds nothing (its blocks are keyed apart, in Redis too),
the same adapter again finds its own blocks in the store from the other prefill node.
"""
from __future__ import annotations

import concurrent.futures as cf
import random
import statistics
import time
from typing import NamedTuple

import httpx
import openai
import pytest
import redis
from lora_util import make_adapter, peft_greedy

from pdserve.models.builtin import ensure_builtin_model
from pdserve.offline.llm import LLM
from pdserve.protocol.block_keys import block_key_chain
from pdserve.protocol.cache_salt import tenant_cache_salt
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.testing.redis_server import redis_server
from pdserve.testing.up_cluster import node_stats, running_cluster, wait_for

BS = 16
LONG = 2048  # tokens in the isolation prompt (the figure): 128 blocks
KEYS = "key-alpha:alpha,key-beta:beta,key-open"  # two keyed tenants and a key naming none
MAX_TOKENS = 4
MODEL = "builtin:tiny"


def _prompt(seed: int, n: int = LONG) -> list[int]:
    return [(seed * 31 + 7 * i + i * i % 13) % 200 + 20 for i in range(n)]


class Adapters(NamedTuple):
    paths: dict[str, str]  # name -> PEFT directory
    short: list[list[int]]  # two prompts sharing a block: the second round hits it
    long: list[int]  # the isolation prompt, sent under no other scope in this module
    peft: cf.Future  # model name -> PEFT's greedy tokens for short + [long]

    def want(self, model: str) -> list[list[int]]:
        return self.peft.result()[model]


def _peft_references(base, paths: dict, prompts: list[list[int]]) -> dict[str, list[list[int]]]:
    want = {name: peft_greedy(base, path, prompts, MAX_TOKENS) for name, path in paths.items()}
    want[MODEL] = peft_greedy(base, None, prompts, MAX_TOKENS)
    assert len({tuple(w[-1]) for w in want.values()}) == len(want), "each adapter should change the output"
    return want


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Two PEFT adapters of builtin:tiny's checkpoint (the one every node materialises) and PEFT's
    own greedy tokens, the reference the cluster must equal: computed while the cluster starts."""
    root, base = tmp_path_factory.mktemp("adapters"), ensure_builtin_model(MODEL)
    paths = {"sql": make_adapter(base, root / "sql", seed=1, r=8, alpha=16),
             "chat": make_adapter(base, root / "chat", seed=2, r=4, alpha=8, use_rslora=True,
                                  targets=["q_proj", "v_proj", "gate_proj", "down_proj"])}
    rng = random.Random(3)
    shared = [rng.randrange(3, 200) for _ in range(20)]
    short = [shared + [rng.randrange(3, 200) for _ in range(n)] for n in (5, 17)]
    long = _prompt(40)
    with cf.ThreadPoolExecutor(1) as pool:
        yield Adapters({k: str(v) for k, v in paths.items()}, short, long,
                       pool.submit(_peft_references, base, paths, [*short, long]))


@pytest.fixture(scope="module")
def cluster(adapters):
    with redis_server() as (url, _proc):
        store = url.replace("redis://", "direct+redis://")
        with running_cluster("--prefill-nodes", "2", "--decode-nodes", "1", "--kv-transfer", "store",
                             "--store", store, "--prefill-policy", "round_robin", "--num-kv-blocks", "600",
                             "--api-key", KEYS, "--max-loras", "2",
                             "--lora-modules", *(f"{k}={v}" for k, v in adapters.paths.items())) as (base, _):
            adapters.peft.result()  # done before any test: no PEFT work beside the timed requests
            yield base, redis.Redis.from_url(url)


@pytest.fixture(scope="module")
def offline():
    return LLM("builtin:tiny", num_kv_blocks=300)


def _client(base: str, key: str, tenant: str | None = None) -> openai.OpenAI:
    headers = {"x-tenant-id": tenant} if tenant else None
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120, default_headers=headers)


def _stream(client: openai.OpenAI, prompt: list[int], model: str = MODEL, **extra) -> tuple[float, int, list[int]]:
    """(time to the first token, cached_tokens, the token ids) of one greedy streamed completion."""
    t0 = time.perf_counter()
    ttft, ids, cached = None, [], None
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True, "return_token_ids": True, **extra})
    for chunk in stream:
        if chunk.choices and (chunk.choices[0].model_extra or {}).get("token_ids"):
            ttft = ttft or time.perf_counter() - t0
            ids += chunk.choices[0].model_extra["token_ids"]
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return ttft, cached, ids


def _prefills(base: str) -> dict[str, dict]:
    return {n: s for n, s in node_stats(base).items() if s["role"] == "prefill"}


class Run(NamedTuple):
    ttft: float
    cached: int  # usage's cached_tokens
    ids: list[int]
    node: str  # the prefill node that served it
    store_tokens: int  # prompt tokens that node loaded from the store for it


def _run(base: str, client: openai.OpenAI, prompt: list[int], **extra) -> Run:
    """One greedy streamed request and the prefill node that took it (node stats ride on pings;
    a node's request count and store hits move in the same pong)."""
    before = _prefills(base)
    streamed = _stream(client, prompt, **extra)
    moved = wait_for(lambda: [(n, s) for n, s in _prefills(base).items()
                              if s["requests_total"] > before[n]["requests_total"]])
    assert len(moved) == 1, moved
    node, after = moved[0]
    return Run(*streamed, node, after["cached_tokens_store"] - before[node]["cached_tokens_store"])


def _store_blocks(raw: redis.Redis, keys: list[bytes]) -> int:
    """Leading blocks of `keys` in Redis, read raw (direct Redis: prefix + the key in hex)."""
    return next((i for i, k in enumerate(keys) if not raw.exists(b"pdkv:" + k.hex().encode())), len(keys))


def test_tenants_never_share_a_prefix_across_nodes_and_the_store(cluster, offline):
    base, raw = cluster
    alpha, beta, plain = _client(base, "key-alpha"), _client(base, "key-beta"), _client(base, "key-open")
    _stream(plain, _prompt(99))  # warm-up: the first requests pay one-time costs
    _stream(plain, _prompt(98))
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    cold, other, hit = [], [], []
    for rnd in range(3):
        prompt = _prompt(rnd)
        runs = {name: _run(base, client, prompt) for name, client in (
            ("cold", plain), ("alpha", alpha), ("beta", beta), ("beta again", beta), ("alpha again", alpha))}
        # The same prompt, fresh for tenant alpha: an unkeyed client's blocks are not alpha's.
        assert runs["cold"].cached == 0 and runs["alpha"].cached == 0
        assert runs["beta"].cached == 0, "tenant beta found tenant alpha's (or the open key's) blocks"
        assert runs["beta"].store_tokens == 0, "tenant beta's node loaded blocks from the store"
        assert runs["beta"].node != runs["alpha"].node, "round robin: beta's prompt is prefilled on the other node"
        # Each repeat lands on the node that did not prefill it and loads the prompt from Redis.
        assert runs["beta again"].node == runs["alpha"].node and runs["alpha again"].node == runs["beta"].node
        assert min(runs["beta again"].cached, runs["alpha again"].cached) >= (LONG - 1) // BS * BS
        want = offline.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)[0].outputs[0].token_ids
        assert {r.ids == want for r in runs.values()} == {True}, "not the offline engine's tokens"
        cold.append(runs["cold"].ttft)
        other.append(runs["beta"].ttft)
        hit.append(runs["beta again"].ttft)
    # The store holds each tenant's prompt under its own keys: a lookup by another salt misses.
    salt = offline.engine.request_salt
    for tenant in ("alpha", "beta", None):  # None: the open key's cold request
        keys = block_key_chain(_prompt(0), BS, salt(tenant_cache_salt(tenant, None)))
        assert _store_blocks(raw, keys) == LONG // BS
    for other_salt in ("alpha", tenant_cache_salt("gamma", None), tenant_cache_salt("alpha", "x")):
        assert _store_blocks(raw, block_key_chain(_prompt(0), BS, salt(other_salt))) == 0
    # Counters ride the nodes' pongs: wait for the one after the last hit.
    wait_for(lambda: min(node_stats(base)[n]["cached_tokens_store"] for n in ("prefill-0", "prefill-1"))
             >= 3 * ((LONG - 1) // BS * BS))
    # Timing: another tenant's prompt costs what a cold one does (a generous factor: a shared
    # 2-core machine), and clearly more than a hit does, which a prober would otherwise see.
    cold_s, other_s, hit_s = (statistics.median(x) for x in (cold, other, hit))
    print(f"TTFT medians: cold {cold_s * 1e3:.0f} ms, other tenant {other_s * 1e3:.0f} ms, "
          f"hit {hit_s * 1e3:.0f} ms")
    assert cold_s / 2.5 < other_s < cold_s * 2.5, (cold, other, hit)
    assert hit_s < other_s / 2, (cold, other, hit)


def test_adapters_match_peft_with_the_kv_handed_over_through_the_store(cluster, adapters):
    """Both prefill nodes and the decode node apply the request's adapter, and the decode node
    reads the prompt's KV from Redis: greedy tokens equal PEFT's. The second round hits the blocks
    the first put in the store (or left on the node), under each request's own adapter."""
    base, _ = cluster
    client = _client(base, "key-open")
    cases = [(model, i) for i in range(len(adapters.short)) for model in (MODEL, *adapters.paths)]
    before = node_stats(base)["decode-0"]
    for rnd in range(2):
        with cf.ThreadPoolExecutor(len(cases)) as pool:
            got = list(pool.map(lambda c: _stream(client, adapters.short[c[1]], model=c[0]), cases))
        for (model, i), (_, cached, ids) in zip(cases, got):
            assert ids == adapters.want(model)[i], f"{model}, prompt {i}, round {rnd}"
            assert rnd == 0 or cached >= BS, f"{model}, prompt {i}: no prefix hit"
    done = before["transfers_ok"] + 2 * len(cases)
    decode = wait_for(lambda: (lambda s: s if s["transfers_ok"] >= done else None)(node_stats(base)["decode-0"]))
    assert decode["transfers_failed"] == before["transfers_failed"]  # nothing recomputed on the decode node
    assert decode["transfer_bytes_store"] > before["transfer_bytes_store"]
    assert {n["id"]: set(n["loras"]) for n in node_stats(base).values()} == dict.fromkeys(
        ("prefill-0", "prefill-1", "decode-0"), set(adapters.paths))


def test_adapters_never_share_a_prefix_across_nodes_and_the_store(cluster, adapters, offline):
    """The same 2,048-token prompt under adapter sql, then chat: chat's prefill node (the other
    one) finds nothing, locally or in Redis. Each adapter's repeat lands on the other node and
    loads that adapter's own blocks from Redis. In Redis each adapter's blocks sit under its own
    salt, and none under the base model's."""
    base, raw = cluster
    client = _client(base, "key-open")
    prompt, full = adapters.long, (LONG - 1) // BS * BS
    runs = {name: _run(base, client, prompt, model=name.split()[0])
            for name in ("sql", "chat", "chat again", "sql again")}
    assert runs["sql"].cached == 0 and runs["chat"].cached == 0, "adapter chat found adapter sql's blocks"
    assert runs["chat"].store_tokens == 0, "adapter chat's node loaded blocks from the store"
    assert runs["chat"].node != runs["sql"].node, "round robin: chat's prompt is prefilled on the other node"
    assert runs["chat again"].node == runs["sql"].node and runs["sql again"].node == runs["chat"].node
    for name in ("chat again", "sql again"):  # the other node: loaded from Redis
        assert runs[name].cached >= full and runs[name].store_tokens >= full, (name, runs[name][1:])
    for name, run in runs.items():
        assert run.ids == adapters.want(name.split()[0])[-1], f"{name}: not PEFT's tokens"
    salts = {adapter: offline.engine.request_salt(None, adapter) for adapter in (*adapters.paths, None)}
    assert len(set(salts.values())) == len(salts)
    for adapter in adapters.paths:
        assert _store_blocks(raw, block_key_chain(prompt, BS, salts[adapter])) == LONG // BS, adapter
    assert _store_blocks(raw, block_key_chain(prompt, BS, salts[None])) == 0
    hit_s = min(runs["chat again"].ttft, runs["sql again"].ttft)
    print(f"TTFT: sql {runs['sql'].ttft * 1e3:.0f} ms, chat {runs['chat'].ttft * 1e3:.0f} ms, "
          f"repeats {runs['chat again'].ttft * 1e3:.0f}, {runs['sql again'].ttft * 1e3:.0f} ms")
    assert runs["chat"].ttft > 2 * hit_s, "another adapter's copy of the prompt should cost a cold prefill"


def test_header_tenants_and_cache_salts_mix(cluster):
    """x-tenant-id names the tenant for a key that names none; a keyed client's header is
    ignored; cache_salt partitions further inside a tenant."""
    base, _ = cluster
    prompt = _prompt(7, 10 * BS + 3)
    full = 10 * BS

    def cached(key: str, tenant: str | None = None, **extra) -> int:
        return _stream(_client(base, key, tenant), prompt, **extra)[1]

    # Two prefill nodes in turn: ask twice so one of them holds each scope's blocks locally
    # (the store holds them too: a hit either way).
    assert cached("key-open", "t1") == 0
    assert cached("key-open", "t2") == 0
    assert cached("key-open", "t1") == full
    assert cached("key-open", "t1", cache_salt="s") == 0
    assert cached("key-open", None, cache_salt="s") == 0, "cache_salt alone is no tenant's"
    assert cached("key-open", "t1", cache_salt="s") == full
    assert cached("key-alpha") == 0
    assert cached("key-alpha", "t1") == full, "a keyed client's header must not move it out of its tenant"
    assert cached("key-beta", "alpha") == 0, "a keyed client's header must not move it into another tenant"


@pytest.mark.parametrize("route", ["completions", "chat/completions", "responses"])
def test_malformed_salts_are_400(cluster, route):
    base, _ = cluster
    body = {"completions": {"prompt": "hi", "max_tokens": 1},
            "chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
            "responses": {"input": "hi", "max_output_tokens": 1}}[route]
    auth = {"Authorization": "Bearer key-open"}
    for salt in ("", 7, ["a"], "x" * 257, "a\u0000b"):
        r = httpx.post(f"{base}/v1/{route}", json={**body, "cache_salt": salt}, headers=auth, timeout=30)
        assert r.status_code == 400, (salt, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{base}/v1/{route}", json=body, headers={**auth, "x-tenant-id": "t" * 300}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-tenant-id", r.text
    r = httpx.post(f"{base}/v1/{route}", json={**body, "cache_salt": "ok"}, headers=auth, timeout=60)
    assert r.status_code == 200, r.text
