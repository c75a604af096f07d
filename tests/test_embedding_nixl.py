"""Image embeddings over NIXL (pdserve.kvstore.embedding_nixl): an encoder-side publisher and a
reader, two real agents in this process. The rows READ are the ones published, bit for bit; a
repeated image reuses its blocks; pinned blocks are never evicted, unpinned ones are, least
recently used first; a reader's notification or the lease's end unpins; blocks rewritten after
the handover fail their digests.
"""
from __future__ import annotations

import time

import pytest
import torch

from pdserve.kvstore.embedding_nixl import BLOCK_ROWS, MIN_ARENA_ROWS, EmbeddingFetcher, EmbeddingPublisher
from pdserve.kvstore.nixl_transfer import nixl_import_error

_why = nixl_import_error()
if _why is not None:  # pragma: no cover - depends on the optional extra
    pytest.skip(f"nixl not importable: {_why}", allow_module_level=True)

HIDDEN = 24
ARENA_BLOCKS = MIN_ARENA_ROWS // BLOCK_ROWS


@pytest.fixture
def pair():
    publisher = EmbeddingPublisher("test-encoder", 0, HIDDEN, torch.bfloat16, lease_s=30)
    fetcher = EmbeddingFetcher("test-reader", 0, HIDDEN, torch.bfloat16)
    peer = fetcher.arena.agent.add_peer(publisher.arena.agent.metadata())
    yield publisher, fetcher, peer
    fetcher.close()
    publisher.close()


def _fetch(publisher: EmbeddingPublisher, fetcher: EmbeddingFetcher, peer: str, content_hash: str, lease_id: str):
    entry = publisher.entries[content_hash]
    regions = publisher.arena.agent.block_regions(entry.block_ids)
    return fetcher.fetch(peer, regions, entry.digests, entry.rows, lease_id.encode(), timeout_s=5)


def _unpinned_by_notification(publisher: EmbeddingPublisher, content_hash: str) -> bool:
    deadline = time.monotonic() + 5
    while publisher.entries[content_hash].leases and time.monotonic() < deadline:
        publisher.poll()
        time.sleep(0.01)
    return not publisher.entries[content_hash].leases


def test_rows_arrive_bit_exact_and_the_notification_unpins(pair):
    publisher, fetcher, peer = pair
    rows = torch.randn(2 * BLOCK_ROWS + 5, HIDDEN).to(torch.bfloat16)  # the last block padded
    entry = publisher.publish("a" * 32, rows, "r1|a")
    assert len(entry.block_ids) == 3 and entry.leases == {"r1|a"}
    got = _fetch(publisher, fetcher, peer, "a" * 32, "r1|a")
    assert got.dtype == torch.bfloat16 and torch.equal(got, rows)
    assert _unpinned_by_notification(publisher, "a" * 32)
    assert len(fetcher.arena.free) == fetcher.arena.tensor.shape[0]  # the reader's blocks are free again


def test_a_repeated_image_reuses_its_blocks(pair):
    publisher, _, _ = pair
    rows = torch.randn(BLOCK_ROWS, HIDDEN)
    first = publisher.publish("b" * 32, rows, "r1|b")
    again = publisher.publish("b" * 32, torch.zeros(BLOCK_ROWS, HIDDEN), "r2|b")  # not written again
    assert again is first and first.leases == {"r1|b", "r2|b"}
    assert len(publisher.arena.free) == ARENA_BLOCKS - 1


def test_pinned_images_stay_unpinned_ones_make_room(pair):
    publisher, _, _ = pair
    big = torch.randn((ARENA_BLOCKS // 2) * BLOCK_ROWS, HIDDEN)
    publisher.publish("c" * 32, big, "r1|c")
    publisher.publish("d" * 32, big, "r2|d")
    assert publisher.publish("e" * 32, big, "r3|e") is None  # all pinned: no room
    publisher.leases["r1|c"] = ("c" * 32, time.monotonic() - 1)  # its lease ended
    publisher.poll()
    assert publisher.leases_expired == 1
    assert publisher.publish("e" * 32, big, "r3|e") is not None
    assert "c" * 32 not in publisher.entries and "d" * 32 in publisher.entries


def test_blocks_rewritten_after_the_handover_fail_their_digests(pair):
    publisher, fetcher, peer = pair
    rows = torch.randn(BLOCK_ROWS, HIDDEN)
    entry = publisher.publish("f" * 32, rows, "r1|f")
    publisher.arena.tensor[entry.block_ids[0], 3] ^= 0x10  # reused since its digest was taken
    assert _fetch(publisher, fetcher, peer, "f" * 32, "r1|f") is None
    assert fetcher.integrity_failures == 1


def test_a_handover_that_does_not_match_its_rows_is_not_read(pair):
    publisher, fetcher, peer = pair
    entry = publisher.publish("g" * 32, torch.randn(BLOCK_ROWS, HIDDEN), "r1|g")
    regions = publisher.arena.agent.block_regions(entry.block_ids)
    assert fetcher.fetch(peer, regions, entry.digests, 3 * BLOCK_ROWS, b"r1|g", timeout_s=5) is None
