"""The MLA latent layout (one plane per layer: kv_lora_rank + qk_rope_head_dim values per token)
through every KV store against a real redis-server and a real LMCache engine, and its salt and
shape checks against the K/V-per-head layout."""
from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
import torch

from pdserve.kvstore.base import KVStore
from pdserve.kvstore.factory import make_store
from pdserve.kvstore.layout import KVLayout
from pdserve.protocol.block_keys import block_key_chain, kv_entry_dims
from pdserve.testing.redis_server import redis_server

# DeepSeek-V3's latent (512 + 64) scaled down: 3 layers, 40 + 8 values per token.
MLA = KVLayout(num_layers=3, num_kv_heads=1, head_dim=48, block_size=16, model_name="test-mla", planes=1)
# A K/V-per-head cache with the same bytes per block (2 planes x 24): it must never be mistaken for MLA.
KV_SAME_BYTES = KVLayout(num_layers=3, num_kv_heads=1, head_dim=24, block_size=16, model_name="test-mla")
NUM_BLOCKS = 10
BACKENDS = ["memory", "redis", "lmcache"]


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with redis_server() as (url, _proc):
        yield url


@pytest.fixture
def make(redis_url: str) -> Iterator[Callable[[str, KVLayout], KVStore]]:
    made: list[KVStore] = []

    def _make(kind: str, layout: KVLayout) -> KVStore:
        url = {"memory": "memory://", "redis": redis_url.replace("redis://", "direct+redis://"),
               "lmcache": redis_url}[kind]
        extra = {"local_cpu_gb": 0.02, "chunk_tokens": 32} if kind == "lmcache" else {}
        made.append(make_store(url, layout=layout, **extra))
        return made[-1]

    yield _make
    for store in made:
        store.close()


def cache(layout: KVLayout, seed: int | None) -> torch.Tensor:
    shape = (NUM_BLOCKS, *layout.block_shape())
    if seed is None:
        return torch.zeros(shape)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def chain(layout: KVLayout, num_tokens: int, seed: int) -> tuple[list[bytes], list[int]]:
    rng = random.Random(seed)
    tokens = [rng.randrange(50_000) for _ in range(num_tokens)]
    keys = block_key_chain(tokens, layout.block_size, layout.salt(), include_partial=True)
    return keys, [min(16, num_tokens - i * 16) for i in range(len(keys))]


def test_layout_shape_bytes_and_salt():
    deepseek = SimpleNamespace(kv_lora_rank=40, qk_rope_head_dim=8, num_attention_heads=4, head_dim=8,
                               num_key_value_heads=4, hidden_size=64, num_hidden_layers=3)
    assert kv_entry_dims(deepseek) == (1, 1, 48)
    assert KVLayout.for_model(deepseek, 16, torch.float32, "test-mla") == MLA
    assert MLA.block_shape(5) == (3, 1, 5, 1, 48)
    assert MLA.block_nbytes() == KV_SAME_BYTES.block_nbytes() == 3 * 16 * 48 * 4
    assert MLA.salt() != KV_SAME_BYTES.salt(), "a latent layout must not share block keys with a K/V one"
    assert KVLayout.from_cache(cache(MLA, None), "test-mla") == MLA


@pytest.mark.parametrize("kind", BACKENDS)
def test_latent_blocks_roundtrip_bit_exact(kind: str, make) -> None:
    keys, counts = chain(MLA, 5 * 16 + 7, seed=1)
    src, dst = cache(MLA, 1), cache(MLA, None)
    src_ids = random.Random(2).sample(range(NUM_BLOCKS), len(keys))
    dst_ids = random.Random(3).sample(range(NUM_BLOCKS), len(keys))
    writer = make(kind, MLA)
    writer.put(keys, src, src_ids, counts)
    # Redis and LMCache: read through a second client (LMCache: its CPU tier empty, so from Redis).
    reader = writer if kind == "memory" else make(kind, MLA)
    assert reader.lookup_prefix(keys) == len(keys)
    assert reader.get(keys, dst, dst_ids, counts) == len(keys)
    for d, s, n in zip(dst_ids, src_ids, counts):
        assert torch.equal(dst[d, :, :, :n], src[s, :, :, :n])
        assert not dst[d, :, :, n:].any()


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_kv_layout_value_is_not_read_into_a_latent_cache(kind: str, make) -> None:
    """Same key bytes forced onto both layouts (a store shared by two deployments): a K/V block
    of equal size is refused by the latent cache's shape check, not loaded."""
    keys, counts = chain(MLA, 32, seed=5)
    writer = make(kind, KV_SAME_BYTES)
    writer.put(keys, cache(KV_SAME_BYTES, 5), [0, 1], counts)
    reader = writer if kind == "memory" else make(kind, MLA)
    dst = cache(MLA, None)
    assert reader.get(keys, dst, [2, 3], counts) == 0
    assert not dst.any()
