"""The default store's LMCache tiers (local CPU -> local disk -> Redis over resp://), its LMCache
config file, and resp:// surviving a Redis restart: real LMCache engines, real redis-servers.

Tier tests empty Redis (FLUSHALL) after the put, so whatever a store still reads can only come
from its own local tiers; a fresh store (empty tiers) reading nothing proves Redis is empty."""
from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import torch

from pdserve.kvstore.base import KVStore
from pdserve.kvstore.factory import make_store
from pdserve.kvstore.layout import KVLayout
from pdserve.testing.redis_server import REDIS_SERVER, _ping, free_port, redis_server

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, model_name="test-tiers")
CHUNK_TOKENS = 32  # 2 blocks, 8 KiB per chunk
N = 64  # blocks: 32 chunks, 256 KiB
TINY_CPU_GB = 64 / (1 << 20)  # a 64 KiB CPU tier holds 8 of the 32 chunks


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with redis_server() as (url, _proc):
        yield url


@pytest.fixture
def make(redis_url: str) -> Iterator[Callable[..., KVStore]]:
    made: list[KVStore] = []

    def _make(url: str | None = None, **kwargs: object) -> KVStore:
        kwargs.setdefault("chunk_tokens", CHUNK_TOKENS)
        store = make_store(url or redis_url, layout=LAYOUT, **kwargs)
        made.append(store)
        return store

    yield _make
    for store in made:
        store.close()


def blocks(seed: int) -> tuple[list[bytes], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    keys = [bytes([seed, i]) * 8 for i in range(N)]
    return keys, torch.randn(N, LAYOUT.num_layers, 2, LAYOUT.block_size, LAYOUT.num_kv_heads,
                             LAYOUT.head_dim, generator=g)


def read_back(store: KVStore, keys: list[bytes], src: torch.Tensor) -> int:
    dst = torch.zeros_like(src)
    got = store.get(keys, dst, list(range(N))[::-1], [16] * N)
    assert torch.equal(dst.flip(0)[:got], src[:got]), "blocks read back differ"
    return got


def test_cpu_tier_serves_what_redis_lost(make: Callable[..., KVStore], redis_url: str) -> None:
    keys, src = blocks(1)
    store = make(local_cpu_gb=0.01)
    store.put(keys, src, list(range(N)), [16] * N)
    # What a put may skip: whole chunks in Redis itself, which every other node reads.
    assert store.shared_prefix(keys) == N and store.shared_prefix(keys[:5]) == 4
    redis.Redis.from_url(redis_url).flushall()
    assert make(local_cpu_gb=0.01).lookup_prefix(keys) == 0  # Redis is empty
    assert store.lookup_prefix(keys) == N
    assert store.shared_prefix(keys) == 0, "blocks only this node's CPU tier holds must be written again"
    assert read_back(store, keys, src) == N


@pytest.mark.parametrize("disk", [False, True])
def test_disk_tier_holds_what_the_cpu_tier_evicted(make: Callable[..., KVStore], redis_url: str,
                                                   tmp_path: Path, disk: bool) -> None:
    """The CPU tier holds a quarter of the chunks and evicts the oldest (the prefix's head); with
    a disk tier every chunk is still local, without one the run breaks at chunk 0."""
    keys, src = blocks(2)
    options = {"local_disk": str(tmp_path / "tier"), "local_disk_gb": 0.01} if disk else {}
    store = make(local_cpu_gb=TINY_CPU_GB, **options)
    store.put(keys, src, list(range(N)), [16] * N)
    redis.Redis.from_url(redis_url).flushall()
    if disk:
        deadline = time.monotonic() + 10  # the disk tier writes in the background
        while store.lookup_prefix(keys) < N and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(list((tmp_path / "tier").iterdir())) >= N // 2 - 8  # chunks on disk
    assert read_back(store, keys, src) == (N if disk else 0)


def test_a_cpu_tier_of_two_chunks_puts_every_chunk_to_disk(redis_url: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A put of 16 chunks of 2 MiB through a CPU tier of 2, onto a slow disk (each write 20 ms
    late, as under a busy machine's I/O): each chunk holds its CPU memory until the disk tier has
    written it, so the store waits for those writes between parts; without the wait LMCache finds
    no room and drops the later chunks (they never reach disk or Redis)."""
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend  # optional dependency: lmcache
    save = LocalDiskBackend.async_save_bytes_to_disk

    def slow_save(self, *args, **kwargs):
        time.sleep(0.02)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(LocalDiskBackend, "async_save_bytes_to_disk", slow_save)
    layout = KVLayout(num_layers=8, num_kv_heads=4, head_dim=64, block_size=16, model_name="test-disk-wait")
    chunk_tokens, n = 256, 256  # blocks: 16 chunks, 32 MiB
    keys = [bytes([6, i]) * 8 for i in range(n)]
    src = torch.randn(n, *layout.block_shape())
    chunk_gb = layout.block_nbytes(chunk_tokens) / (1 << 30)
    store = make_store(redis_url, layout=layout, chunk_tokens=chunk_tokens, local_cpu_gb=2 * chunk_gb,
                       local_disk=str(tmp_path / "tier"), local_disk_gb=0.1)
    fresh = make_store(redis_url, layout=layout, chunk_tokens=chunk_tokens, local_cpu_gb=2 * chunk_gb)
    try:
        store.put(keys, src, list(range(n)), [16] * n)
        assert fresh.lookup_prefix(keys) == n, "every chunk reached Redis"
        redis.Redis.from_url(redis_url).flushall()
        deadline = time.monotonic() + 10  # the last part's disk writes end in the background
        while store.lookup_prefix(keys) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        dst = torch.zeros_like(src)
        assert store.get(keys, dst, list(range(n)), [16] * n) == n
        assert torch.equal(dst, src)
    finally:
        store.close()
        fresh.close()


def test_a_cpu_tier_of_one_chunk_still_writes_through_to_redis(make: Callable[..., KVStore]) -> None:
    """LMCache stages every chunk in its CPU tier: one chunk of room is enough for every chunk to
    reach Redis (a fresh store reads them all back), and less than one is refused at start, since
    such a store would store nothing and miss on every get."""
    chunk_gb = LAYOUT.block_nbytes(CHUNK_TOKENS) / (1 << 30)
    keys, src = blocks(4)
    make(local_cpu_gb=chunk_gb).put(keys, src, list(range(N)), [16] * N)
    assert read_back(make(local_cpu_gb=chunk_gb), keys, src) == N
    with pytest.raises(ValueError, match="holds no chunk"):
        make(local_cpu_gb=chunk_gb * 0.9)


def write_config(path: Path, **values: object) -> str:
    path.write_text("".join(f"{k}: {v}\n" for k, v in values.items()))
    return str(path)


def test_lmcache_config_file_wins_over_the_shorthands(make: Callable[..., KVStore], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """An LMCache YAML config (its own keys) sets chunk size, tiers and remote: here a second
    Redis named by remote_url gets the chunks although --store names the first."""
    keys, src = blocks(3)
    with redis_server() as (other_url, _proc):
        other = other_url.replace("redis://", "resp://")
        path = write_config(tmp_path / "lmcache.yaml", chunk_size=64, local_cpu="true",
                            max_local_cpu_size=0.01, remote_url=f'"{other}"', remote_serde="naive")
        store = make(lmcache_config=path)
        assert store.chunk_tokens == 64 and str(store.config.remote_url) == other
        store.put(keys, src, list(range(N)), [16] * N)
        raw = redis.Redis.from_url(other_url)
        chunk_values = [n for n in raw.keys(b"test-tiers@*")]
        assert len(chunk_values) == N // 4 and raw.strlen(chunk_values[0]) == 4 * LAYOUT.block_nbytes()
        monkeypatch.setenv("LMCACHE_CONFIG_FILE", path)  # LMCache's own variable works too
        fresh = make(chunk_tokens=None)
        assert fresh.chunk_tokens == 64 and read_back(fresh, keys, src) == N
        bad = write_config(tmp_path / "bad.yaml", chunk_size=40)
        with pytest.raises(ValueError, match="multiple of the block size"):
            make(lmcache_config=bad)
        with pytest.raises(ValueError, match="does not exist"):
            make(lmcache_config=str(tmp_path / "missing.yaml"))


def test_resp_client_reconnects_after_a_redis_restart(make: Callable[..., KVStore]) -> None:
    """LMCache's native resp:// client keeps a dead socket; the store must write again once
    Redis is back on the same port."""
    port = free_port()
    cmd = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]

    def start() -> subprocess.Popen:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        while not _ping(port):
            time.sleep(0.05)
        return proc

    proc = start()
    try:
        url = f"redis://127.0.0.1:{port}"
        keys, src = blocks(4)
        store = make(url, local_cpu_gb=0.01)
        store.put(keys, src, list(range(N)), [16] * N)
        proc.kill()
        proc.wait()
        proc = start()
        deadline = time.monotonic() + 15
        attempt = 5
        while True:  # fresh keys each time: chunks already in the CPU tier are not re-sent
            keys, src = blocks(attempt)
            store.put(keys, src, list(range(N)), [16] * N)
            if make(url, local_cpu_gb=0.01).lookup_prefix(keys) == N or time.monotonic() > deadline:
                break
            attempt += 1
            time.sleep(0.5)
        assert read_back(make(url, local_cpu_gb=0.01), keys, src) == N
        assert make(url, local_cpu_gb=0.01).lookup_prefix(blocks(4)[0]) == 0  # the restart lost those
    finally:
        proc.kill()
        proc.wait()
