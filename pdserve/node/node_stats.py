"""A node's counters: what it reports in every pong, for the router's /health and /metrics."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class NodeStats:
    requests_total: int = 0
    transfers_ok: int = 0
    transfers_failed: int = 0
    leases_expired: int = 0
    cached_tokens_store: int = 0   # prompt tokens loaded from the KV store instead of computed
    kv_tokens_borrowed: int = 0    # a prefill node's prompt tokens READ from its decode node's blocks instead
    kv_borrow_failures: int = 0    # ... and the prompts that awaited some and computed them (node.borrowed_prefix)
    kv_borrow_wait_us: int = 0     # ... microseconds those prompts waited for their decode node's WriteTarget
    transfer_bytes_nixl: int = 0
    transfer_bytes_nixl_written: int = 0  # push mode: a prefill node's WRITEs; a decode node's blocks they landed
    transfer_bytes_store: int = 0
    transfer_us_nixl: int = 0      # microseconds spent in KV transfers (pulls, store puts)
    transfer_us_store: int = 0
    transfer_us_nixl_written: int = 0  # push mode: microseconds a prefill node's WRITEs held its loop (cma copies inside the post)
    store_load_us: int = 0         # microseconds spent loading prompt blocks from the store
    store_prefetched_tokens: int = 0  # a decode node's: push-mode prompt tokens loaded from the store before the KVReady
    writeback_blocks: int = 0      # a decode node's own prefills' blocks it wrote to the store
    embedding_requests: int = 0    # /v1/embeddings requests computed here
    embeddings_loaded: int = 0     # images whose embeddings came from an encoder node (E/P/D)
    embedding_bytes_store: int = 0  # bytes of image embeddings put in or loaded from the store
    embedding_bytes_nixl: int = 0   # bytes of image embeddings handed over or READ over NIXL
    embedding_us_nixl: int = 0      # microseconds spent in those READs
