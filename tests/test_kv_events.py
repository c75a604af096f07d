"""KV events: nodes publish the block keys their prefix cache gains and evicts; the router's
index follows them, and a lost batch or a restarted node triggers a snapshot resync. Also: the
router computes block keys with the salt the nodes report, so its chains match a float32 node's
and a bfloat16 node's alike."""
from __future__ import annotations

import openai

from pdserve.assembly.build import build_engine
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import EngineConfig
from pdserve.node.kv_events import DROP_BATCH_ENV, KVEventPublisher
from pdserve.protocol.block_keys import block_key_chain
from pdserve.router.placement.index import PrefixIndex
from pdserve.router.placement.kv_events import KVEventTracker
from pdserve.testing.up_cluster import node_stats, running_cluster, wait_for
from pdserve.wire.messages import KVEvents, Ping


def _keys(*names: str) -> list[bytes]:
    return [n.encode().ljust(16, b".") for n in names]


def test_tracker_applies_batches_in_order_and_resyncs_on_gap_or_new_epoch():
    index = PrefixIndex()
    tracker = KVEventTracker(index)
    a, b, c, d = _keys("a", "b", "c", "d")
    assert tracker.needs_snapshot("n") and not tracker.needs_snapshot("n")  # asked once
    assert not tracker.apply("n", KVEvents("n", 7, 2, [a, b], snapshot=True))
    assert not tracker.apply("n", KVEvents("n", 7, 3, [c], [a]))
    assert index.held_prefix_blocks("n", [b, c]) == 2 and index.held_prefix_blocks("n", [a]) == 0
    # seq 4 lost: seq 5 is not applied, a snapshot is asked for, once.
    assert tracker.apply("n", KVEvents("n", 7, 5, [d]))
    assert not tracker.apply("n", KVEvents("n", 7, 6, [d]))
    assert index.held_prefix_blocks("n", [d]) == 0
    assert not tracker.apply("n", KVEvents("n", 7, 6, [b, d], snapshot=True))
    assert index.size("n") == 2 and index.held_prefix_blocks("n", [c]) == 0
    # The node restarted: a new epoch is never applied on top of the old state.
    assert tracker.apply("n", KVEvents("n", 8, 1, [a]))
    assert tracker.counters["kv_resyncs"] == 2 and tracker.counters["kv_snapshots"] == 2


def test_publisher_batches_net_changes_numbers_them_and_snapshots():
    pool = BlockPool(2)
    sent: list[tuple[bytes, KVEvents]] = []
    pub = KVEventPublisher(pool, "n", lambda ident, msg: sent.append((ident, msg)))
    a, b, c = _keys("a", "b", "c")
    pool.cache_block(pool.allocate(1)[0], a)
    pub.flush(force=True)
    assert sent == [], "no router has asked: nothing is sent"
    pub.snapshot(b"router")
    assert sent[-1][1].snapshot and sent[-1][1].stored == [a]
    ids = pool.allocate(1)
    pool.cache_block(ids[0], b)
    pool.free([pool.cached[a]])
    pool.free(ids)
    pool.cache_block(pool.allocate(1)[0], c)  # evicts a, the least recently freed
    pub.flush(force=True)
    batch = sent[-1][1]
    assert (batch.seq, batch.stored, batch.removed) == (sent[-2][1].seq + 1, [b, c], [a])


def test_router_keys_use_the_salt_the_node_reports_float32_and_bfloat16():
    from pdserve.router.main import build_backend
    prompt = list(range(20, 90))
    for dtype in ("float32", "bfloat16"):
        engine = build_engine(EngineConfig(model="builtin:tiny", dtype=dtype, num_kv_blocks=16))
        node_keys = block_key_chain(prompt, engine.config.block_size, engine.salt)
        backend = build_backend([], ["tcp://127.0.0.1:1"], salt=b"a router-side guess!")
        node = backend.nodes[0]
        backend.pool._on_pong(node, _node_pong(engine))
        assert backend.block_keys(prompt) == node_keys
        backend.pool.nodes[0].sock.close(0)


def _node_pong(engine):
    from pdserve.node.runtime import NodeRuntime
    runtime = NodeRuntime(engine, "tcp://127.0.0.1:0", "decode-0")
    try:
        return runtime.pong(Ping(1))
    finally:
        runtime.close()


def test_event_gap_on_a_real_node_triggers_a_resync(monkeypatch):
    monkeypatch.setenv(DROP_BATCH_ENV, "3")  # the node never sends its third batch
    with running_cluster("--prefill-nodes", "0", "--decode-nodes", "1", "--num-kv-blocks", "48") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        for i in range(8):  # 48 blocks: later prompts evict earlier ones, so removals flow too
            prompt = [(31 * i + j) % 200 + 20 for j in range(96)]
            client.completions.create(model="builtin:tiny", prompt=prompt, max_tokens=8, temperature=0)

        def in_step():
            stats = node_stats(url)["decode-0"]
            health = __import__("httpx").get(f"{url}/health", timeout=5).json()
            return (health["kv_events"]["kv_resyncs"] >= 1
                    and stats["kv_event_seq_applied"] == stats["kv_event_seq"] > 3
                    and stats["index_blocks"] >= stats["cached_blocks"] > 0)
        wait_for(in_step, timeout_s=20)
