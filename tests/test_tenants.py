"""Tenant isolation without sockets: a request's salt (its cache_salt and/or tenant) keys its KV
blocks apart from every other tenant's, in the engine's prefix cache, in the block keys the
nodes and the store use, and in the router's prefix index; no salt keeps today's keys.
The cluster path (Redis, two prefill nodes, TTFT) is in test_tenants_cluster.py."""
from __future__ import annotations

import pytest

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.offline.llm import LLM
from pdserve.protocol.block_keys import block_key_chain, kv_layout_salt, request_salt
from pdserve.protocol.cache_salt import MAX_CACHE_SALT_BYTES, check_cache_salt, tenant_cache_salt
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.router.main import build_backend
from pdserve.router.placement.index import STORE_HOLDER
from pdserve.router.placement.keys import KVScope
from pdserve.router.placement.policy import NodeView
from pdserve.router.routes.tenants import parse_api_keys

BS = 16
LAYOUT = kv_layout_salt("builtin:tiny", 4, 4, 32, "float32", BS)
PROMPT = [(7 * i) % 200 + 20 for i in range(10 * BS + 5)]  # 10 full blocks and a partial one


def _keys(salt_string: str | None, adapter: str | None = None) -> list[bytes]:
    """The request's block keys as the engine's KV cache manager computes them."""
    kv = KVCacheManager(BlockPool(32), BS, LAYOUT)
    salt = request_salt(LAYOUT, salt_string, adapter)
    return kv.block_keys(Request("r", PROMPT, SamplingParams(), cache_salt=salt_string, salt=salt))


def test_keys_differ_per_tenant_match_within_one_and_no_salt_keeps_todays_keys():
    today = block_key_chain(PROMPT, BS, LAYOUT)
    assert _keys(None) == today
    assert KVCacheManager(BlockPool(32), BS, LAYOUT).block_keys(Request("r", PROMPT, SamplingParams())) == today
    alpha, beta = tenant_cache_salt("alpha", None), tenant_cache_salt("beta", None)
    assert _keys(alpha) == _keys(alpha) and len(_keys(alpha)) == 10
    # Not one block in common (the salt enters the first key and every key chains on it).
    salted = [_keys(alpha), _keys(beta), _keys("salt-1"), _keys(tenant_cache_salt("alpha", "salt-1")),
              _keys("alpha"), today, _keys(None, adapter="alpha")]
    for i, a in enumerate(salted):
        for b in salted[i + 1:]:
            assert not set(a) & set(b)


def test_no_client_cache_salt_reaches_a_tenants_salt_string():
    """A tenant's salt string holds a NUL, which a client's cache_salt may not: no body field
    can name another tenant's blocks. Tenant and cache_salt mix injectively."""
    forms = {tenant_cache_salt(t, s) for t in (None, "a", "b", "a:b") for s in (None, "a", "b", "x")} - {None}
    assert len(forms) == 3 * 4 + 3
    for form in forms:
        if form.startswith("\x00"):
            with pytest.raises(ValueError, match="NUL"):
                check_cache_salt(form)
    for bad, why in ((5, "string"), ("", "empty"), ("x" * (MAX_CACHE_SALT_BYTES + 1), "256 bytes"),
                     ("é" * 129, "256 bytes"), ("a\x00b", "NUL")):
        with pytest.raises(ValueError, match=why):
            check_cache_salt(bad)
    check_cache_salt("é" * 128)  # 256 bytes: the limit is in bytes, and inclusive


def test_api_keys_name_tenants():
    assert parse_api_keys("k1:alpha, k2 ,k:3:beta") == {b"k1": "alpha", b"k2": None, b"k:3": "beta"}
    assert parse_api_keys(None) == {} and parse_api_keys("") == {}
    for bad in ("k1:", ":alpha", "k1,,:x"):
        with pytest.raises(ValueError, match="entry"):
            parse_api_keys(bad)


def test_router_index_never_matches_another_tenants_blocks():
    """The router's own block keys (ClusterBackend.block_keys) carry the request's scope: its
    prefix index credits a node with tenant alpha's blocks for alpha's requests only."""
    backend = build_backend([], [], salt=LAYOUT, block_size=BS, registry="tcp://127.0.0.1:9")
    alpha, beta = KVScope(tenant_cache_salt("alpha", None)), KVScope(tenant_cache_salt("beta", None))
    assert backend.block_keys(PROMPT) == block_key_chain(PROMPT, BS, LAYOUT)
    assert backend.block_keys(PROMPT, alpha) == _keys(alpha.cache_salt)  # what the nodes compute
    backend.index.add("decode-1", backend.block_keys(PROMPT, alpha))
    decode = [NodeView("decode-0", total_blocks=64, free_blocks=64), NodeView("decode-1", total_blocks=64,
                                                                                free_blocks=64)]
    planned = {name: backend.planner.plan(name, len(PROMPT), backend.block_keys(PROMPT, scope), decode, [])
               for name, scope in (("alpha", alpha), ("beta", beta), ("none", KVScope()))}
    assert planned["alpha"].decode == "decode-1" and planned["alpha"].decode_cached_tokens == 10 * BS
    assert planned["beta"].decode_cached_tokens == 0 and planned["none"].decode_cached_tokens == 0
    assert backend.index.prefix_match(backend.block_keys(PROMPT, beta)) == {}


def test_router_index_keeps_adapters_apart():
    """The adapter enters the router's keys as it enters the nodes' and the store's: blocks
    indexed for adapter sql (on a node, or in the store) match sql's requests only."""
    backend = build_backend([], [], salt=LAYOUT, block_size=BS, registry="tcp://127.0.0.1:9")
    sql = KVScope(adapter="sql")
    assert backend.block_keys(PROMPT, sql) == _keys(None, adapter="sql")  # what the nodes compute
    backend.index.add("prefill-0", backend.block_keys(PROMPT, sql))
    backend.index.add(STORE_HOLDER, backend.block_keys(PROMPT, sql))
    assert backend.index.prefix_match(backend.block_keys(PROMPT, sql)) == {"prefill-0": 10, STORE_HOLDER: 10}
    for other in (KVScope(adapter="chat"), KVScope(), KVScope(tenant_cache_salt("alpha", None), "sql")):
        assert backend.index.prefix_match(backend.block_keys(PROMPT, other)) == {}, other


@pytest.fixture(scope="module")
def llm():
    return LLM("builtin:tiny", num_kv_blocks=64)


def test_offline_prompts_share_cached_blocks_only_under_one_salt(llm):
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    def run(prompt: dict):
        out = llm.generate(prompt, greedy, use_tqdm=False)[0]
        return out.num_cached_tokens, out.outputs[0].token_ids

    plain = run({"prompt_token_ids": PROMPT})
    assert plain[0] == 0
    first, other, again = (run({"prompt_token_ids": PROMPT, "cache_salt": s}) for s in ("alpha", "beta", "alpha"))
    assert first[0] == 0 and other[0] == 0, "another salt's blocks (and unsalted ones) must not be hits"
    assert again[0] == 10 * BS
    assert run({"prompt_token_ids": PROMPT})[0] == 10 * BS  # unsalted prompts share as before
    assert first[1] == other[1] == again[1] == plain[1]  # the salt changes which blocks, never the tokens
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": PROMPT, "cache_salt": ""}, greedy, use_tqdm=False)
