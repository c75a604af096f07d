"""The numpy step-input builder against the direct per-token formula (slot = block * size +
offset, the request's own block ids, context = tokens so far) on mixed decode/prefill batches,
and the CUDA-graph batch buckets. Pure host code: runs anywhere."""
from __future__ import annotations

import random

import numpy as np
import pytest

from pdserve.engine.cuda_graphs import batch_buckets
from pdserve.engine.request import Request
from pdserve.engine.step_inputs import build_step_inputs, fill_decode_rows
from pdserve.protocol.sampling_params import SamplingParams

BS = 4


def _request(rng: random.Random, i: int, computed: int, total: int) -> Request:
    req = Request(str(i), [rng.randrange(1000) for _ in range(total)], SamplingParams())
    req.num_computed_tokens = computed
    req.block_ids = rng.sample(range(10_000), -(-total // BS) + rng.randrange(2))
    return req


def _expected(items):
    """The per-token formula, one Python loop per token (the runner's former list code)."""
    tokens, positions, slots, rows, sampled = [], [], [], [], []
    for req, n in items:
        for p in range(req.num_computed_tokens, req.num_computed_tokens + n):
            tokens.append(req.all_token_ids[p])
            positions.append(p)
            slots.append(req.block_ids[p // BS] * BS + p % BS)
        if req.num_computed_tokens + n == req.num_tokens:
            rows.append(len(tokens) - 1)
            sampled.append(req)
    return tokens, positions, slots, rows, sampled


@pytest.mark.parametrize("seed", range(5))
def test_build_step_inputs_matches_the_per_token_formula(seed):
    rng = random.Random(seed)
    decodes = [(_request(rng, i, c, c + 1), 1) for i, c in enumerate(rng.sample(range(1, 60), 7))]
    prefills = []
    for i in range(3):
        total = rng.randrange(2, 50)
        computed = rng.randrange(0, total - 1)
        n = rng.randrange(2, total - computed + 1) if total - computed >= 2 else 1
        prefills.append((_request(rng, 100 + i, computed, total), n))
    prefills = [(r, n) for r, n in prefills if n > 1]
    items = decodes + prefills
    got = build_step_inputs(items, len(decodes), BS)
    tokens, positions, slots, rows, sampled = _expected(items)
    assert got.ints64.tolist() == [tokens, positions, slots]
    assert got.sample_rows == rows and got.to_sample == sampled
    assert got.decode_context_lens.tolist() == [r.num_computed_tokens + 1 for r, _ in decodes]
    for table, reqs in ((got.decode_tables, [r for r, _ in decodes]), (got.prefill_tables, [r for r, _ in prefills])):
        assert table.shape == (len(reqs), max((len(r.block_ids) for r in reqs), default=1))
        for row, r in zip(table, reqs):
            assert row[:len(r.block_ids)].tolist() == r.block_ids and not row[len(r.block_ids):].any()
    assert got.prefill_cu_seqlens.tolist() == np.cumsum([0] + [n for _, n in prefills]).tolist()
    assert got.prefill_context_lens.tolist() == [r.num_computed_tokens + n for r, n in prefills]
    flat = got.ints32()
    assert flat.dtype == np.int32 and flat.size == sum(int(np.prod(s)) for s in got.int32_shapes())


@pytest.mark.parametrize("seed", range(3))
def test_drafted_queries_run_as_one_decode_row_per_token(seed):
    """A request's last token and its drafts: one decode row per token (context up to itself,
    the request's table), laid out with the plain decodes ahead of the prefills."""
    rng = random.Random(seed)
    items = []
    for i, c in enumerate(rng.sample(range(1, 60), 6)):
        drafts = [rng.randrange(1000) for _ in range(rng.choice([0, 0, 1, 4]))]
        req = _request(rng, i, c, c + 1 + len(drafts))
        req.spec_token_ids = drafts
        items.append((req, 1 + len(drafts)))
    prefill = _request(rng, 99, 3, 20)
    items.append((prefill, 17))
    got = build_step_inputs(items, 6, BS)
    tokens, positions, slots, _, sampled = _expected(items)
    assert got.ints64.tolist() == [tokens, positions, slots]
    n_decode = sum(n for _, n in items[:6])
    assert got.num_decode_tokens == n_decode and got.to_sample == sampled
    assert got.decode_context_lens.tolist() == [p + 1 for p in positions[:n_decode]]
    owners = [r for r, n in items[:6] for _ in range(n)]
    for row, r in zip(got.decode_tables, owners):
        assert row[:len(r.block_ids)].tolist() == r.block_ids
    assert got.sample_rows == [i for i in range(n_decode)] + [len(tokens) - 1]
    assert got.prefill_context_lens.tolist() == [20] and got.prefill_cu_seqlens.tolist() == [0, 17]


def test_fill_decode_rows_leaves_rows_past_n_and_stale_columns_unread():
    rng = random.Random(7)
    reqs = [_request(rng, i, c, c + 1) for i, c in enumerate((3, 17, 40))]
    ints64 = np.full((3, 8), 99, np.int64)
    ctx = np.full(8, 99, np.int32)
    tables = np.full((8, 20), -5, np.int32)
    fill_decode_rows(reqs, BS, ints64, ctx, tables)
    tokens, positions, slots, _, _ = _expected([(r, 1) for r in reqs])
    assert ints64[:, :3].tolist() == [tokens, positions, slots]
    assert (ints64[:, 3:] == 99).all() and (ctx[3:] == 99).all() and (tables[3:] == -5).all()
    assert ctx[:3].tolist() == [4, 18, 41]
    for row, r in zip(tables, reqs):
        assert row[:len(r.block_ids)].tolist() == r.block_ids


def test_batch_buckets_cover_every_batch_size():
    for max_batch in (1, 3, 16, 100, 256):
        buckets = batch_buckets(max_batch)
        assert buckets == sorted(set(buckets)) and buckets[-1] == max_batch
        for n in range(1, max_batch + 1):
            b = next(b for b in buckets if b >= n)
            assert b - n < max(16, n)  # padding stays under a bucket step
    assert batch_buckets(256)[:5] == [1, 2, 4, 8, 16] and 256 in batch_buckets(256)


def test_enforce_eager_flag_reaches_engine_config_and_node_commands():
    """`--enforce-eager` on `pdserve up` is forwarded to every node, whose parser turns it into
    EngineConfig.enforce_eager; without it, graphs stay on."""
    from pdserve.engine.config import EngineConfig
    from pdserve.entrypoints.cli import build_parser, engine_options
    from pdserve.entrypoints.launcher import Cluster
    parser = build_parser()
    for flags, eager in (([], False), (["--enforce-eager"], True)):
        up = parser.parse_args(["up", *flags])
        cmd = Cluster(up).node_cmd("decode", "d0", "tcp://127.0.0.1:1", [])
        assert ("--enforce-eager" in cmd) == eager
        node = parser.parse_args(cmd[cmd.index("decode"):])
        assert EngineConfig(**engine_options(node)).enforce_eager is eager


def test_kept_table_rows_match_a_fresh_build_through_appends_preemption_and_reuse():
    """Steps of a changing batch: blocks appended, requests leaving and joining, a preempted
    request back with as many (different) blocks in a new list (as KVCacheManager.free leaves
    it), an id used again by a new request, more requests than rows. Every step's rows equal a
    from-scratch build."""
    from pdserve.engine.step_inputs import KeptTableRows
    rng = random.Random(3)
    kept = KeptTableRows(capacity=8, width=32)
    live = {i: _request(rng, i, 5, 6) for i in range(6)}
    next_id = 6
    for step in range(60):
        action = rng.random()
        if action < 0.15 and live:  # preempted: blocks freed, later as many different ones
            req = rng.choice(list(live.values()))
            req.block_ids = rng.sample(range(10_000, 20_000), len(req.block_ids))
        elif action < 0.25 and live:  # finished; its id comes back as a new request
            rid = rng.choice(list(live))
            live[rid] = _request(rng, rid, 3, 4)
        elif action < 0.35:
            live[next_id] = _request(rng, next_id, 2, 3)
            next_id += 1
        for req in live.values():  # decoding: now and then a new block
            if rng.random() < 0.3 and len(req.block_ids) < 32:
                req.block_ids.append(rng.randrange(20_000, 30_000))
        batch = [r for r in live.values() if rng.random() < 0.9][:7]
        if len(live) > 7:
            live.pop(next(iter(live)))
        if not batch:
            continue
        out = np.full((len(batch), 32), -9, np.int32)
        kept.fill(batch, out)
        for row, req in zip(out, batch):
            assert row[:len(req.block_ids)].tolist() == req.block_ids, step
