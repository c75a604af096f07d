"""Tenant isolation through a real `pdserve up` cluster: two prefill nodes (round robin, so a
request and its repeat land on different nodes), one decode node, the KV store on a real
redis-server (tests/redis_util.py, direct Redis so its keys can be read back).

Tenants come from API keys (`--api-key KEY:TENANT`), from the x-tenant-id header, and mix with
the body's cache_salt. A tenant's repeat finds its prompt in the store from the other prefill
node; another tenant's identical prompt finds nothing anywhere (cached_tokens 0) and takes as long
as a cold prompt, so its timing says nothing about what others sent (CVE-2025-46570).
"""
from __future__ import annotations

import statistics
import time

import httpx
import openai
import pytest
import redis
from cluster_util import node_stats, running_cluster, wait_for
from redis_util import redis_server

from pdserve.engine.block_keys import block_key_chain
from pdserve.engine.cache_salt import tenant_cache_salt
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams

BS = 16
LONG = 2048  # tokens in the isolation prompt (the figure): 128 blocks
KEYS = "key-alpha:alpha,key-beta:beta,key-open"  # two keyed tenants and a key naming none
MAX_TOKENS = 4


def _prompt(seed: int, n: int = LONG) -> list[int]:
    return [(seed * 31 + 7 * i + i * i % 13) % 200 + 20 for i in range(n)]


@pytest.fixture(scope="module")
def cluster():
    with redis_server() as (url, _proc):
        store = url.replace("redis://", "direct+redis://")
        with running_cluster("--prefill-nodes", "2", "--decode-nodes", "1", "--kv-transfer", "store",
                             "--store", store, "--prefill-policy", "round_robin", "--num-kv-blocks", "600",
                             "--api-key", KEYS) as (base, _):
            yield base, redis.Redis.from_url(url)


@pytest.fixture(scope="module")
def offline():
    return LLM("builtin:tiny", num_kv_blocks=300)


def _client(base: str, key: str, tenant: str | None = None) -> openai.OpenAI:
    headers = {"x-tenant-id": tenant} if tenant else None
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120, default_headers=headers)


def _stream(client: openai.OpenAI, prompt: list[int], **extra) -> tuple[float, int, list[int]]:
    """(time to the first token, cached_tokens, the token ids) of one greedy streamed completion."""
    t0 = time.perf_counter()
    ttft, ids, cached = None, [], None
    stream = client.completions.create(model="builtin:tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True, "return_token_ids": True, **extra})
    for chunk in stream:
        if chunk.choices and (chunk.choices[0].model_extra or {}).get("token_ids"):
            ttft = ttft or time.perf_counter() - t0
            ids += chunk.choices[0].model_extra["token_ids"]
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return ttft, cached, ids


def _prefills(base: str) -> dict[str, int]:
    return {n: s["requests_total"] for n, s in node_stats(base).items() if s["role"] == "prefill"}


def _served_by(base: str, before: dict[str, int]) -> str:
    """The prefill node that took the one request sent since `before` (node stats ride on pings)."""
    moved = wait_for(lambda: [n for n, c in _prefills(base).items() if c > before[n]])
    assert len(moved) == 1, moved
    return moved[0]


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
        runs = {}
        for name, client in (("cold", plain), ("alpha", alpha), ("beta", beta), ("beta again", beta),
                             ("alpha again", alpha)):
            before = _prefills(base)
            runs[name] = (*_stream(client, prompt), _served_by(base, before))
        # The same prompt, fresh for tenant alpha: an unkeyed client's blocks are not alpha's.
        assert runs["cold"][1] == 0 and runs["alpha"][1] == 0
        assert runs["beta"][1] == 0, "tenant beta found tenant alpha's (or the open key's) blocks"
        assert runs["beta"][3] != runs["alpha"][3], "round robin: beta's prompt is prefilled on the other node"
        # Each repeat lands on the node that did not prefill it and loads the prompt from Redis.
        assert runs["beta again"][3] == runs["alpha"][3] and runs["alpha again"][3] == runs["beta"][3]
        assert min(runs["beta again"][1], runs["alpha again"][1]) >= (LONG - 1) // BS * BS
        want = offline.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)[0].outputs[0].token_ids
        assert {r[2] == want for r in runs.values()} == {True}, "not the offline engine's tokens"
        cold.append(runs["cold"][0])
        other.append(runs["beta"][0])
        hit.append(runs["beta again"][0])
    # The store holds each tenant's prompt under its own keys: a lookup by another salt misses.
    salt = offline.engine.request_salt
    for tenant in ("alpha", "beta", None):  # None: the open key's cold request
        keys = block_key_chain(_prompt(0), BS, salt(tenant_cache_salt(tenant, None)))
        assert _store_blocks(raw, keys) == LONG // BS
    for other_salt in ("alpha", tenant_cache_salt("gamma", None), tenant_cache_salt("alpha", "x")):
        assert _store_blocks(raw, block_key_chain(_prompt(0), BS, salt(other_salt))) == 0
    stats = node_stats(base)
    assert min(stats[n]["cached_tokens_store"] for n in ("prefill-0", "prefill-1")) >= 3 * ((LONG - 1) // BS * BS)
    # Timing: another tenant's prompt costs what a cold one does (a generous factor: a shared
    # 2-core machine), and clearly more than a hit does, which a prober would otherwise see.
    cold_s, other_s, hit_s = (statistics.median(x) for x in (cold, other, hit))
    print(f"TTFT medians: cold {cold_s * 1e3:.0f} ms, other tenant {other_s * 1e3:.0f} ms, "
          f"hit {hit_s * 1e3:.0f} ms")
    assert cold_s / 2.5 < other_s < cold_s * 2.5, (cold, other, hit)
    assert hit_s < other_s / 2, (cold, other, hit)


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
