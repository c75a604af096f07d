"""The LMCache engine config for a pdserve store: from an LMCache config file (the same YAML a
vLLM LMCache connector takes: chunk_size, local_cpu, max_local_cpu_size, local_disk,
max_local_disk_size, remote_url, remote_serde, extra_config, ...), or built from pdserve's
shorthands (--store-chunk-tokens, the URL's local_cpu_gb / local_disk / local_disk_gb).

A file wins over the shorthands; the --store URL fills in remote_url only where the file has none.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from pdserve.kvstore.layout import KVLayout
from pdserve.kvstore.lmcache_compat import LMCacheEngineConfig

CONFIG_ENV = "LMCACHE_CONFIG_FILE"  # LMCache's own variable for the same file
# Measured with benchmarks/kv_transfer/bench_kvstore.py --chunk-tokens (docs/benchmarks/kv-transfer.md): 256 reads
# fastest from Redis; smaller chunks pay a round trip each.
DEFAULT_CHUNK_TOKENS = 256


@dataclass(frozen=True)
class TierOptions:
    """pdserve's shorthands for the LMCache tiers (used when no config file is given)."""

    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    local_cpu_gb: float = 1.0
    local_disk: str | None = None  # a directory (or file:///dir/) for the disk tier
    local_disk_gb: float = 0.0
    blocking_timeout_s: int = 5


def config_file_from_env(explicit: str | None) -> str | None:
    return explicit or os.environ.get(CONFIG_ENV) or None


def build_config(layout: KVLayout, remote_url: str | None, tiers: TierOptions,
                 config_file: str | None = None) -> LMCacheEngineConfig:
    """The engine config, checked against what pdserve's chunked store needs."""
    if config_file:
        if not os.path.isfile(config_file):
            raise ValueError(f"LMCache config file {config_file!r} does not exist")
        config = LMCacheEngineConfig.from_file(config_file)
        if config.remote_url is None and remote_url is not None:
            config.remote_url = remote_url
    else:
        disk = tiers.local_disk
        if disk is not None:
            os.makedirs(disk.removeprefix("file://"), exist_ok=True)
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=tiers.chunk_tokens, local_cpu=True, max_local_cpu_size=tiers.local_cpu_gb,
            local_disk=disk, max_local_disk_size=tiers.local_disk_gb if disk else 0.0,
            remote_url=remote_url, remote_serde="naive", save_unfull_chunk=False,
            py_enable_gc=True, blocking_timeout_secs=tiers.blocking_timeout_s)
    check_config(config, layout)
    return config


def check_config(config: LMCacheEngineConfig, layout: KVLayout) -> None:
    chunk = int(config.chunk_size)
    if chunk <= 0 or chunk % layout.block_size:
        raise ValueError(f"LMCache chunk_size {chunk} must be a positive multiple of the block size "
                         f"{layout.block_size}: one chunk holds whole blocks")
    check_cpu_tier_holds_a_chunk(config, layout)
    if config.save_unfull_chunk:
        # Partial chunks never reach LMCache (they go through the direct tail path), and
        # resp:// refuses the flag outright.
        config.save_unfull_chunk = False
    if config.remote_url is not None and not str(config.remote_url).startswith(("resp://", "redis://",
                                                                               "redis-cluster://")):
        raise ValueError(f"LMCache remote_url must be resp://, redis:// or redis-cluster:// for pdserve "
                         f"(its digests and partial chunks live in the same Redis), got {config.remote_url!r}")


def cpu_tier_bytes(config: LMCacheEngineConfig) -> int:
    return int(float(config.max_local_cpu_size or 0) * (1 << 30))


def chunk_bytes(config: LMCacheEngineConfig, layout: KVLayout) -> int:
    """One chunk's KV bytes, all layers: what LMCache allocates in its CPU tier for it."""
    return layout.block_nbytes(int(config.chunk_size))


def check_cpu_tier_holds_a_chunk(config: LMCacheEngineConfig, layout: KVLayout) -> None:
    """LMCache stages every chunk it stores or loads in its CPU tier, whatever tier it goes to
    next: a tier smaller than one chunk stores nothing anywhere (it logs 'Local cpu memory under
    pressure' and drops the chunk), so a store on it would silently miss every time."""
    chunk = chunk_bytes(config, layout)
    if cpu_tier_bytes(config) < chunk:
        raise ValueError(f"LMCache max_local_cpu_size {config.max_local_cpu_size} GB holds no chunk of "
                         f"{int(config.chunk_size)} tokens ({chunk / 1e6:.1f} MB for this model): LMCache "
                         f"stages every chunk in its CPU tier, even for disk and Redis, so nothing would be "
                         f"stored. Raise it to at least {chunk / (1 << 30):.3f} GB or lower chunk_size")
