"""The CPU KV pool written at start (--kv-cache-prefault, issue 61): on where the operator gave the
pool's size, off for the default pool; the pool's pages are resident once built, and the output is
the lazily written pool's. The lazily written pool gets its pages written just ahead of the blocks
handed out (pdserve.assembly.pool_pages.WriteAhead)."""
from __future__ import annotations

import os

import pytest
import torch
from smaps import mapping_bytes

from pdserve import LLM, SamplingParams
from pdserve.assembly.pool_pages import WriteAhead, zeroed_pool
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import prefault_default
from pdserve.entrypoints.cli import build_parser
from pdserve.entrypoints.up_commands import node_engine_flags

POOL_GB = 0.0625


@pytest.mark.parametrize(("flags", "prefault"), [
    ([], False),                                     # the default pool: a share of the machine
    (["--kv-cache-memory-gb", "1"], True),           # a size the operator gave: reserved now
    (["--num-kv-blocks", "64"], True),
    (["--kv-cache-memory-gb", "1", "--no-kv-cache-prefault"], False),
    (["--kv-cache-prefault"], True),
])
def test_prefault_is_on_where_the_pool_size_is_given(flags, prefault):
    for command in ("serve", "up"):
        assert prefault_default(build_parser().parse_args([command, *flags])) is prefault


def test_up_forwards_the_choice_to_its_nodes():
    parser = build_parser()
    assert "--no-kv-cache-prefault" in node_engine_flags(parser.parse_args(["up", "--no-kv-cache-prefault"]))
    assert "--kv-cache-prefault" in node_engine_flags(parser.parse_args(["up", "--kv-cache-prefault"]))
    assert not any("prefault" in f for f in node_engine_flags(parser.parse_args(["up"])))


def resident_bytes(address: int) -> int:
    return mapping_bytes(address, "Rss")


def test_a_prefaulted_pool_is_resident_and_serves_the_same_tokens():
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(7 * i + 3 * k) % 200 + 10 for k in range(40 + 9 * i)]} for i in range(4)]
    outputs, resident = {}, {}
    for prefault in (False, True):
        llm = LLM("builtin:tiny", kv_cache_memory_gb=POOL_GB, kv_cache_prefault=prefault)
        pool = llm.engine.runner.kv_cache
        resident[prefault] = resident_bytes(pool.data_ptr()) / (pool.numel() * pool.element_size())
        outputs[prefault] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    assert resident[True] >= 0.99, resident   # every page written at start
    assert resident[False] < 0.5, resident    # the lazy pool: only what was written
    assert outputs[True] == outputs[False]


def test_tensor_parallel_pool_is_allocated_at_start_where_asked():
    """At TP 2 the pool is one shared file that every rank maps (pdserve.executor.kv_shared):
    allocated whole at start where the prefault is on, as used where it is off; the same tokens."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(5 * i + 2 * k) % 200 + 10 for k in range(30 + 7 * i)]} for i in range(3)]
    outputs, allocated = {}, {}
    for prefault in (False, True):
        llm = LLM("builtin:tiny", kv_cache_memory_gb=POOL_GB, kv_cache_prefault=prefault, tensor_parallel_size=2)
        try:
            executor = llm.engine.runner.executor
            pool_bytes = executor.kv_cache.numel() * executor.kv_cache.element_size()
            allocated[prefault] = os.fstat(executor._kv_fd).st_blocks * 512 / pool_bytes
            outputs[prefault] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.close()
    assert allocated[True] >= 0.99, allocated
    assert allocated[False] < 0.5, allocated
    assert outputs[True] == outputs[False]


def test_the_default_pool_is_written_just_ahead_of_the_blocks_handed_out():
    """The lazily written pool (the default's) gets its pages written a chunk ahead of the highest
    block handed out, in one call, not page by page inside the step; never past that chunk."""
    pool = zeroed_pool((64, 8, 4096), torch.float32, torch.device("cpu"))  # 128 KiB blocks, 8 MiB
    block_bytes, chunk = 8 * 4096 * 4, 256 * 1024
    blocks = BlockPool(64)
    blocks.fresh_hook = WriteAhead(pool, chunk_bytes=chunk)
    assert resident_bytes(pool.data_ptr()) == 0
    first = blocks.allocate(3)  # blocks 0-1 written as block 0 is handed out, then 2-3 with block 2
    assert resident_bytes(pool.data_ptr()) == 2 * chunk == 4 * block_bytes
    blocks.free(first)
    blocks.allocate(1)  # block 3 (fresh blocks leave first): already written
    assert resident_bytes(pool.data_ptr()) == 4 * block_bytes
    blocks.allocate(1)  # block 4: one more chunk
    assert resident_bytes(pool.data_ptr()) == 3 * chunk
    assert not pool.any()  # still the zeroed pool


def test_an_engine_writes_its_default_pool_ahead_and_a_prefaulted_one_at_start():
    lazy = LLM("builtin:tiny", kv_cache_memory_gb=POOL_GB, kv_cache_prefault=False)
    prefaulted = LLM("builtin:tiny", kv_cache_memory_gb=POOL_GB, kv_cache_prefault=True)
    assert isinstance(lazy.engine.kv.pool.fresh_hook, WriteAhead)
    assert prefaulted.engine.kv.pool.fresh_hook is None
    pool = lazy.engine.runner.kv_cache
    lazy.generate([{"prompt_token_ids": list(range(10, 90))}], SamplingParams(max_tokens=4), use_tqdm=False)
    block_bytes = pool.numel() * pool.element_size() // pool.shape[0]
    assert resident_bytes(pool.data_ptr()) >= lazy.engine.kv.pool.fresh_from * block_bytes > 0
