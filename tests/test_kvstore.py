"""KV store backends against a real redis-server and a real LMCache engine.

"lmcache" is the default redis:// store with 2-block chunks (CHUNK_TOKENS), so short chains
exercise both whole chunks (LMCache over resp://) and the tail (direct Redis)."""
from __future__ import annotations

import multiprocessing
import random
import time
from collections.abc import Callable, Iterator

import pytest
import redis
import torch

from pdserve.kvstore.base import KVStore
from pdserve.kvstore.errors import KVStoreError
from pdserve.kvstore.factory import make_store
from pdserve.kvstore.layout import KVLayout
from pdserve.kvstore.memory_store import MemoryKVStore
from pdserve.kvstore.redis_store import HEADER, RedisKVStore
from pdserve.protocol.block_keys import block_key_chain
from pdserve.testing.redis_server import redis_server, start_redis_server, stop_redis_server

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, model_name="test-kv")
NUM_BLOCKS = 12
BACKENDS = ["memory", "redis", "lmcache"]
CHUNK_TOKENS = 2 * 16


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with redis_server() as (url, _proc):
        yield url


@pytest.fixture
def raw(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def make(redis_url: str) -> Iterator[Callable[[str], KVStore]]:
    """Store factory by backend name; every store it made is closed after the test."""
    made: list[KVStore] = []

    def _make(kind: str, layout: KVLayout = LAYOUT) -> KVStore:
        url = {"memory": "memory://", "redis": redis_url.replace("redis://", "direct+redis://"),
               "lmcache": redis_url}[kind]
        lmcache = {"local_cpu_gb": 0.02, "chunk_tokens": CHUNK_TOKENS}
        store = make_store(url, layout=layout, **(lmcache if kind == "lmcache" else {}))
        made.append(store)
        return store

    yield _make
    for store in made:
        store.close()


def paged_cache(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, LAYOUT.num_layers, 2, LAYOUT.block_size, LAYOUT.num_kv_heads,
             LAYOUT.head_dim)
    return torch.randn(shape, generator=g).to(dtype)


def chain(num_tokens: int, seed: int) -> tuple[list[bytes], list[int]]:
    """Block keys of a random prompt, trailing partial block included, and tokens per block."""
    rng = random.Random(seed)
    tokens = [rng.randrange(50_000) for _ in range(num_tokens)]
    keys = block_key_chain(tokens, LAYOUT.block_size, LAYOUT.salt(), include_partial=True)
    bs = LAYOUT.block_size
    counts = [min(bs, num_tokens - i * bs) for i in range(len(keys))]
    return keys, counts


def assert_blocks_equal(dst: torch.Tensor, dst_ids: list[int], src: torch.Tensor,
                        src_ids: list[int], counts: list[int]) -> None:
    for d, s, n in zip(dst_ids, src_ids, counts):
        assert torch.equal(dst[d, :, :, :n], src[s, :, :, :n]), f"block {s}->{d} differs"
        assert not dst[d, :, :, n:].any(), "tokens past a partial block were written"


def reader_for(kind: str, writer: KVStore, make: Callable[[str], KVStore]) -> KVStore:
    """LMCache: read through a second engine whose CPU tier is empty, so blocks come from Redis."""
    return make(kind) if kind == "lmcache" else writer


@pytest.mark.parametrize("kind", BACKENDS)
def test_roundtrip_bit_exact_with_partial_block(kind: str, make: Callable[[str], KVStore]) -> None:
    keys, counts = chain(5 * 16 + 7, seed=1)
    src, dst = paged_cache(1), torch.zeros(NUM_BLOCKS, *paged_cache(0).shape[1:])
    src_ids = random.Random(2).sample(range(NUM_BLOCKS), len(keys))
    dst_ids = random.Random(3).sample(range(NUM_BLOCKS), len(keys))
    writer = make(kind)
    writer.put(keys, src, src_ids, counts)
    reader = reader_for(kind, writer, make)
    assert reader.lookup_prefix(keys) == len(keys)
    assert reader.get(keys, dst, dst_ids, counts) == len(keys)
    assert_blocks_equal(dst, dst_ids, src, src_ids, counts)
    untouched = sorted(set(range(NUM_BLOCKS)) - set(dst_ids))
    assert not dst[untouched].any()


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_roundtrip_bfloat16(kind: str, make: Callable[[str], KVStore]) -> None:
    keys, counts = chain(40, seed=4)
    src = paged_cache(4, torch.bfloat16)
    dst = torch.zeros_like(src)
    store = make(kind)
    store.put(keys, src, [0, 1, 2], counts)
    assert store.get(keys, dst, [5, 6, 7], counts) == 3
    assert_blocks_equal(dst, [5, 6, 7], src, [0, 1, 2], counts)


@pytest.mark.parametrize("kind", BACKENDS)
def test_chain_with_gap(kind: str, make: Callable[[str], KVStore]) -> None:
    keys, counts = chain(5 * 16, seed=5)
    src, dst = paged_cache(5), torch.zeros(NUM_BLOCKS, *paged_cache(0).shape[1:])
    present = [0, 1, 3, 4]  # block 2 missing
    writer = make(kind)
    writer.put([keys[i] for i in present], src, present, [counts[i] for i in present])
    reader = reader_for(kind, writer, make)
    assert reader.lookup_prefix(keys) == 2
    assert reader.lookup_prefix(keys[3:]) == 2
    assert reader.lookup_prefix([]) == 0
    assert reader.get(keys, dst, list(range(5)), counts) == 2
    assert_blocks_equal(dst, [0, 1], src, [0, 1], counts[:2])
    assert not dst[2:].any(), "blocks after the gap must not be loaded"


@pytest.mark.parametrize("kind", BACKENDS)
def test_partial_block_requested_as_full_stops(kind: str, make: Callable[[str], KVStore]) -> None:
    keys, counts = chain(16 + 5, seed=6)
    src, dst = paged_cache(6), torch.zeros(NUM_BLOCKS, *paged_cache(0).shape[1:])
    store = make(kind)
    store.put(keys, src, [0, 1], counts)
    assert store.get(keys, dst, [0, 1], [16, 16]) == 1  # stored 5 tokens, asked for 16


def test_memory_lru_evicts_by_bytes() -> None:
    keys, counts = chain(4 * 16, seed=7)
    src, dst = paged_cache(7), torch.zeros(NUM_BLOCKS, *paged_cache(0).shape[1:])
    store = MemoryKVStore(max_bytes=3 * LAYOUT.block_nbytes())
    store.put(keys[:3], src, [0, 1, 2], counts[:3])
    assert store.get(keys[:1], dst, [0], counts[:1]) == 1  # touch block 0: now most recent
    store.put(keys[3:], src, [3], counts[3:])
    assert [k in store for k in keys] == [True, False, True, True]
    assert store.used_bytes == 3 * LAYOUT.block_nbytes()
    half = LAYOUT.block_nbytes(8)
    store.put([b"p" * 16], src, [4], [8])  # a half block evicts only one full block
    assert store.used_bytes == 2 * LAYOUT.block_nbytes() + half and len(store) == 3


def test_redis_corruption_stops_the_run(make: Callable[[str], KVStore], raw: redis.Redis) -> None:
    keys, counts = chain(4 * 16, seed=8)
    src = paged_cache(8)
    store = make("redis")
    assert isinstance(store, RedisKVStore)
    store.put(keys, src, [0, 1, 2, 3], counts)
    name = store.name(keys[2])
    value = raw.get(name)
    raw.setrange(name, HEADER.size + 100, bytes([value[HEADER.size + 100] ^ 0x01]))
    dst = torch.zeros_like(src)
    assert store.get(keys, dst, [0, 1, 2, 3], counts) == 2
    assert not dst[2:].any()
    for bad in (b"XXXX" + value[4:], value[:-1], value[:10], b""):
        raw.set(name, bad)
        assert store.get(keys, dst, [0, 1, 2, 3], counts) == 2
    assert store.get(keys, torch.zeros_like(src, dtype=torch.float16), [0, 1, 2, 3], counts) == 0


def test_redis_keys_ttl_and_prefix(redis_url: str, raw: redis.Redis) -> None:
    keys, counts = chain(2 * 16, seed=9)
    store = make_store(redis_url.replace("redis://", "direct+redis://") + "?ttl_s=30", prefix=b"pdkv-test:")
    try:
        store.put(keys, paged_cache(9), [0, 1], counts)
        for key in keys:
            name = b"pdkv-test:" + key.hex().encode()
            assert raw.exists(name) and 0 < raw.pttl(name) <= 30_000
    finally:
        store.close()


def chunk_names(raw: redis.Redis, key: bytes) -> list[bytes]:
    from pdserve.kvstore.lmcache_store import chunk_hash
    return raw.keys(f"{LAYOUT.model_name}@*@{chunk_hash(key):x}@*".encode())


def test_lmcache_chunks_and_tail_land_in_redis(make: Callable[[str], KVStore], raw: redis.Redis) -> None:
    """Whole chunks: one resp:// value each, named by the chunk's last block key, one chunk of
    bytes long. The tail (block 4, full, and block 5, partial): direct values, block by block."""
    keys, counts = chain(5 * 16 + 1, seed=10)
    make("lmcache").put(keys, paged_cache(10), [0, 1, 2, 3, 4, 5], counts)
    for i, key in enumerate(keys):
        names = chunk_names(raw, key)
        if i in (1, 3):
            (name,) = names
            assert raw.strlen(name) == 2 * LAYOUT.block_nbytes()
        else:
            assert names == []
        assert raw.exists(b"pdkv:" + key.hex().encode()) == (i >= 4)
        assert raw.exists(b"pdkv-digest:" + key.hex().encode()) == (i < 4)


def test_lmcache_reads_from_an_unaligned_first_block(make: Callable[[str], KVStore]) -> None:
    """A reader that has blocks 0-2 cached asks from block 3: the chunk holding blocks 2-3 is
    fetched, block 2's slot (-1) is left alone, and the tail follows."""
    keys, counts = chain(5 * 16 + 3, seed=14)
    src = paged_cache(14)
    make("lmcache").put(keys, src, list(range(6)), counts)
    dst = torch.zeros_like(src)
    reader = make("lmcache")
    assert reader.get(keys[3:], dst, [9, 10, 11], counts[3:], first_block=3) == 3
    assert_blocks_equal(dst, [9, 10, 11], src, [3, 4, 5], counts[3:])
    assert not dst[:9].any()


def test_lmcache_finds_a_shorter_writers_tail_block_by_block(make: Callable[[str], KVStore]) -> None:
    """A writer's tail (direct path) is found by a longer reader whose chunks cover it."""
    keys, counts = chain(3 * 16 + 5, seed=15)
    src = paged_cache(15)
    make("lmcache").put(keys, src, [0, 1, 2, 3], counts)  # chunk [0,1], tail [2], [3] (partial)
    longer, _ = chain(6 * 16, seed=15)
    reader = make("lmcache")
    assert longer[:3] == keys[:3]
    assert reader.lookup_prefix(longer) == 3
    dst = torch.zeros_like(src)
    assert reader.get(longer[:3], dst, [5, 6, 7], [16] * 3) == 3
    assert_blocks_equal(dst, [5, 6, 7], src, [0, 1, 2], [16] * 3)


def test_lmcache_corruption_is_caught_by_the_digest_ledger(make: Callable[[str], KVStore], raw: redis.Redis) -> None:
    """LMCache checks no payload: a byte flipped in a chunk in Redis must end the loaded run at
    that chunk's block, be counted, and leave the rest to be computed."""
    keys, counts = chain(4 * 16, seed=12)
    src = paged_cache(12)
    make("lmcache").put(keys, src, [0, 1, 2, 3], counts)
    reader = make("lmcache")  # a fresh CPU tier: the chunks come from Redis
    dst = torch.zeros_like(src)
    assert reader.get(keys, dst, [0, 1, 2, 3], counts) == 4 and reader.integrity_failures == 0
    assert_blocks_equal(dst, [0, 1, 2, 3], src, [0, 1, 2, 3], counts)
    (name,) = chunk_names(raw, keys[3])  # blocks 2 and 3; flip a byte in block 3
    value = raw.get(name)
    at = len(value) * 3 // 4
    raw.setrange(name, at, bytes([value[at] ^ 0x01]))
    fresh = make("lmcache")
    dst = torch.zeros_like(src)
    assert fresh.get(keys, dst, [0, 1, 2, 3], counts) == 2
    assert fresh.integrity_failures == 1


def test_lmcache_leaves_process_settings_and_closes_fast(make: Callable[[str], KVStore]) -> None:
    before = multiprocessing.get_start_method(allow_none=True)
    store = make("lmcache")
    assert multiprocessing.get_start_method(allow_none=True) == before
    keys, counts = chain(16, seed=11)
    store.put(keys, paged_cache(11), [0], counts)
    t0 = time.monotonic()
    store.close()
    store.close()  # idempotent
    assert time.monotonic() - t0 < 3.0


def test_redis_down_fails_fast(make: Callable[[str], KVStore]) -> None:
    url, proc = start_redis_server()
    keys, counts = chain(3 * 16, seed=12)
    src, dst = paged_cache(12), torch.zeros(NUM_BLOCKS, *paged_cache(0).shape[1:])
    direct = make_store(url.replace("redis://", "direct+redis://"))
    tiered = make_store(url, layout=LAYOUT, local_cpu_gb=0.02, chunk_tokens=CHUNK_TOKENS)
    try:
        direct.put(keys, src, [0, 1, 2], counts)
        tiered.put(keys, src, [0, 1, 2], counts)
        stop_redis_server(proc)
        t0 = time.monotonic()
        for call in (lambda: direct.put(keys, src, [0, 1, 2], counts),
                     lambda: direct.get(keys, dst, [0, 1, 2], counts),
                     lambda: direct.lookup_prefix(keys)):
            with pytest.raises(KVStoreError):
                call()
        # LMCache reads a dead remote as a miss; its CPU tier still serves the chunk it holds
        # (blocks 0-1); the tail (block 2) is unreadable and ends the run.
        assert tiered.get(keys, dst, [3, 4, 5], counts) == 2
        cold = make_store(url, layout=LAYOUT, local_cpu_gb=0.02, chunk_tokens=CHUNK_TOKENS)
        for call in (lambda: cold.lookup_prefix(keys), lambda: cold.get(keys, dst, [6, 7, 8], counts),
                     lambda: cold.put(keys, src, [0, 1, 2], counts)):  # the tail's store error
            with pytest.raises(KVStoreError):
                call()
        cold.put(keys[:2], src, [0, 1], counts[:2])  # chunks only: LMCache swallows it, no hang
        cold.close()
        assert time.monotonic() - t0 < 15.0
    finally:
        stop_redis_server(proc)
        direct.close()
        tiered.close()


def test_factory_schemes(redis_url: str) -> None:
    assert isinstance(make_store("memory://?max_gb=0.5"), MemoryKVStore)
    assert make_store("memory://?max_gb=0.5").max_bytes == 1 << 29  # type: ignore[attr-defined]
    from pdserve.kvstore.lmcache_store import LMCacheKVStore
    store = make_store(redis_url.replace("redis://", "direct+redis://"))
    assert isinstance(store, RedisKVStore) and store.url == redis_url
    store.close()
    for scheme in ("redis://", "lmcache://", "lmcache+redis://"):
        store = make_store(redis_url.replace("redis://", scheme), layout=LAYOUT, local_cpu_gb=0.01)
        assert isinstance(store, LMCacheKVStore) and store.chunk_tokens == 256
        assert str(store.config.remote_url) == redis_url.replace("redis://", "resp://")
        store.close()
    with pytest.raises(ValueError, match="direct\\+redis://"):
        make_store("s3://bucket")
    with pytest.raises(ValueError, match="layout"):
        make_store(redis_url)
    with pytest.raises(ValueError, match="direct\\+redis://"):
        make_store(redis_url + "?ttl_s=5", layout=LAYOUT)
    with pytest.raises(ValueError, match="multiple of the block size"):
        make_store(redis_url, layout=LAYOUT, chunk_tokens=24)


def test_lmcache_batch_larger_than_cpu_tier(redis_url: str) -> None:
    """A put/get bigger than LMCache's CPU tier must go through whole, not drop the tail."""
    n = 200  # 800 KiB of blocks through a 512 KiB tier
    g = torch.Generator().manual_seed(13)
    src = torch.randn(n, *paged_cache(0).shape[1:], generator=g)
    keys = [bytes([13, i]) * 8 for i in range(n)]
    writer = make_store(redis_url, layout=LAYOUT, local_cpu_gb=0.0005, chunk_tokens=CHUNK_TOKENS)
    reader = make_store(redis_url, layout=LAYOUT, local_cpu_gb=0.0005, chunk_tokens=CHUNK_TOKENS)
    try:
        writer.put(keys, src, list(range(n)), [16] * n)
        dst = torch.zeros_like(src)
        assert reader.get(keys, dst, list(reversed(range(n))), [16] * n) == n
        assert torch.equal(dst, src.flip(0))
    finally:
        writer.close()
        reader.close()
