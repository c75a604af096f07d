"""The store on a real Redis Cluster: 3 masters and 3 replicas from Debian's redis-server.

  * redis-cluster://... through LMCache's cluster connector: whole chunks, the partial-chunk
    tail and the digest ledger are spread over all three masters, and a second store reads every
    block back bit for bit;
  * `pdserve up --kv-transfer store --store redis-cluster://...` with a master SIGKILLed under
    16 streams: its replica takes over, no request is lost, every output equals the offline
    engine's, no block fails its digest, and the store serves prefixes again after the failover.
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import openai
import pytest
import redis
import torch

from pdserve import LLM, SamplingParams
from pdserve.kvstore.digest_ledger import DIGEST_PREFIX
from pdserve.kvstore.factory import make_store
from pdserve.kvstore.layout import KVLayout
from pdserve.kvstore.redis_cluster import parse_cluster_url, redis_client
from pdserve.testing.redis_cluster import redis_cluster
from pdserve.testing.up_cluster import node_stats, running_cluster, wait_for

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, model_name="test-cluster")
N = 41  # 20 chunks of 2 blocks and one block in the tail
PROMPTS = [list(range(2, 100)) + list(range(100 + i, 140 + i)) for i in range(16)]  # a shared 98-token prefix
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def cluster():
    with redis_cluster(masters=3, replicas=1) as c:
        yield c


def test_blocks_spread_over_every_master_and_read_back(cluster):
    g = torch.Generator().manual_seed(3)
    keys = [bytes([9, i]) * 8 for i in range(N)]
    src = torch.randn(N, LAYOUT.num_layers, 2, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim, generator=g)
    writer = make_store(cluster.url, layout=LAYOUT, chunk_tokens=32)
    reader = make_store(cluster.url, layout=LAYOUT, chunk_tokens=32)
    try:
        writer.put(keys, src, list(range(N)), [16] * N)
        dst = torch.zeros_like(src)
        assert reader.get(keys, dst, list(range(N)), [16] * N) == N
        assert torch.equal(dst, src)
        # What a handover may skip: the leading whole chunks the cluster holds, no more.
        assert reader.shared_prefix(keys) == N - 1 and reader.shared_prefix(keys[:9]) == 8
        unseen = [bytes([10, i]) * 8 for i in range(2)]
        assert reader.shared_prefix(unseen + keys[2:]) == 0, "a chain whose first chunk is missing"
    finally:
        writer.close()
        reader.close()
    per_master = cluster.keys_per_master()
    assert len(per_master) == 3 and all(n > 0 for n in per_master.values()), per_master
    client = redis_client(cluster.url)
    try:
        digests = [k for k in client.scan_iter(match=DIGEST_PREFIX + b"*", target_nodes=client.PRIMARIES)]
    finally:
        client.close()
    assert len(digests) >= N - 1, "the digest ledger is not in the cluster"
    assert parse_cluster_url("redis-cluster://u:p%40ss@h1:1,[::1]:2") == ([("h1", 1), ("::1", 2)], "u", "p@ss")


def _stream(url: str, prompt: list[int], started: threading.Event) -> list[int]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=180)
    ids: list[int] = []
    stream = client.completions.create(model="builtin:tiny", prompt=prompt, max_tokens=MAX_TOKENS, stream=True,
                                       temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    for chunk in stream:
        if chunk.choices:
            ids += chunk.choices[0].model_extra.get("token_ids") or []
            started.set()
    return ids


def _store_loads(url: str) -> int:
    return sum(n.get("transfer_bytes_store", 0) for n in node_stats(url).values() if n["role"] == "decode")


def test_a_master_killed_under_load(cluster):
    llm = LLM("builtin:tiny", num_kv_blocks=512)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                         use_tqdm=False)]
    with running_cluster("--kv-transfer", "store", "--store", cluster.url, "--store-chunk-tokens", "32",
                         "--prefill-nodes", "1", "--decode-nodes", "1", "--num-kv-blocks", "512") as (url, _):
        victim = cluster.masters()[0]
        started = threading.Event()
        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = [pool.submit(_stream, url, p, started) for p in PROMPTS]
            assert started.wait(120)
            cluster.kill(victim)
            got = [f.result(timeout=300) for f in futures]
        assert got == want
        cluster.wait_ok()
        # The live node we ask learns of the promotion by gossip: under load (a CI run on 2 busy
        # cores) its view can lag cluster_state:ok, so give it a few seconds.
        deadline = time.monotonic() + 30
        while (victim in cluster.masters() or len(cluster.masters()) != 3) and time.monotonic() < deadline:
            time.sleep(0.2)
        masters = cluster.masters()
        assert victim not in masters and len(masters) == 3, f"no replica took over: masters {masters}"
        assert sum(n.get("integrity_failures", 0) for n in node_stats(url).values()) == 0
        # After the failover the handover goes through the store again: the decode node loads a
        # new prompt's KV from it rather than computing it (LMCache may first reconnect).
        loaded = _store_loads(url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        fresh = iter(range(150, 250))

        def store_serves() -> bool:
            first = next(fresh)
            client.completions.create(model="builtin:tiny", prompt=[first, *range(10, 109)], max_tokens=2,
                                      temperature=0)
            return _store_loads(url) > loaded

        wait_for(store_serves, timeout_s=60, interval_s=1.0)
        with pytest.raises(redis.exceptions.ConnectionError):
            redis.Redis(port=victim, socket_connect_timeout=1).ping()
