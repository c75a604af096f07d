"""Cores lent between the nodes of one machine (pdserve.node.core_board): a node's step runs on
its own share plus the shares of the nodes idle at that moment, never on a busy node's; and
`pdserve up` (lending by default) serves the same greedy tokens as the offline engine with steps run
on lent cores, its board file gone once it stops."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pdserve.node.core_board import LEND_AFTER_S, SLOTS, CoreBoard, create_board


@pytest.fixture
def board_path(tmp_path):
    path = str(tmp_path / "board")
    create_board(path)
    return path


def test_a_step_borrows_only_the_cores_of_nodes_idle_a_while(board_path):
    prefill, decode = CoreBoard(board_path, 0, 1, 3), CoreBoard(board_path, 1, 1, 3)
    lend_ns = int(LEND_AFTER_S * 1e9)
    assert prefill.step_threads(now_ns=10**12) == 1  # the decode node starts busy (busy until it says idle)
    decode.mark_idle(now_ns=10**12)
    assert prefill.step_threads(now_ns=10**12 + lend_ns // 2) == 1  # idle for a moment: between streams
    decode.mark_idle(now_ns=10**12 + lend_ns)  # still idle: the time it went idle stays
    assert prefill.step_threads(now_ns=10**12 + lend_ns) == 2
    assert decode.step_threads(now_ns=2 * 10**12) == 1  # marking itself busy first: the prefill node is busy
    assert prefill.step_threads(now_ns=2 * 10**12) == 1  # the decode node is busy again: nothing lent
    prefill.mark_idle(now_ns=2 * 10**12)
    third = CoreBoard(board_path, 2, 2, 3)  # a third node, busy: lends nothing
    assert decode.step_threads(now_ns=3 * 10**12) == 2
    third.mark_idle(now_ns=2 * 10**12)
    assert decode.step_threads(now_ns=3 * 10**12) == 3  # 1 + 1 + 2, capped at the machine's 3 cores


def test_a_step_with_little_prompt_to_compute_borrows_nothing(board_path):
    prefill, decode = CoreBoard(board_path, 0, 1, 2, min_prefill_tokens=512), CoreBoard(board_path, 1, 1, 2)
    decode.mark_idle(now_ns=10**12)
    later = 10**12 + int(LEND_AFTER_S * 1e9)
    assert prefill.step_threads(now_ns=later, prefill_tokens=511) == 1
    assert prefill.step_threads(now_ns=later, prefill_tokens=512) == 2
    assert prefill.step_threads(now_ns=later) == 2  # (work that is not a step: whatever is idle)


def test_a_decode_step_has_no_prompt_left_and_borrows_with_no_minimum(board_path):
    """A decoding request has computed past its prompt: none of it is left (the count was
    negative, so that `--lend-min-prompt-tokens 0` never let a decode node's steps borrow)."""
    from pdserve import LLM, SamplingParams  # the engine: only this test steps one
    engine = LLM("builtin:tiny", num_kv_blocks=64).engine
    engine.add_request("r", list(range(5, 25)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for _ in range(4):
        engine.step()
    request = engine.scheduler.requests["r"]
    assert request.num_computed_tokens > request.num_prompt_tokens  # decoding
    left = engine.scheduler.longest_prompt_to_compute()
    assert left == 0
    prefill, decode = CoreBoard(board_path, 0, 1, 2), CoreBoard(board_path, 1, 1, 2, min_prefill_tokens=0)
    prefill.mark_idle(now_ns=10**12)
    assert decode.step_threads(now_ns=10**12 + int(LEND_AFTER_S * 1e9), prefill_tokens=left) == 2


def test_a_closed_node_lends_nothing_and_run_sets_the_threads(board_path, monkeypatch):
    set_to: list[int] = []
    monkeypatch.setattr("pdserve.node.core_board.set_compute_threads", lambda n: set_to.append(n) or n)
    a, b = CoreBoard(board_path, 0, 1, 2), CoreBoard(board_path, 1, 1, 2)
    b.close()  # share 0: its slot lends nothing
    assert a.run(lambda: "step") == "step" and set_to == [1] and a.lent_steps == 0
    b = CoreBoard(board_path, 1, 1, 2)
    b.mark_idle(now_ns=time.monotonic_ns() - int(LEND_AFTER_S * 1e9))
    a.run(lambda: None)
    assert set_to == [1, 2] and a.lent_steps == 1 and a.widest_lent_threads == 2
    a.run(lambda: None)
    assert set_to == [1, 2]  # unchanged: not set again


def test_a_step_that_computes_nothing_keeps_the_node_idle(board_path, monkeypatch):
    """A decode node whose requests all wait for their KV (push mode: admitted while the prompt
    computes on the prefill node) still steps, computing nothing: it stays idle since when it
    went idle, so the prefill node keeps borrowing its core; a step that computed is busy."""
    monkeypatch.setattr("pdserve.node.core_board.set_compute_threads", lambda threads: None)
    prefill, decode = CoreBoard(board_path, 0, 1, 2), CoreBoard(board_path, 1, 1, 2)
    went_idle = time.monotonic_ns() - int(LEND_AFTER_S * 1e9)
    decode.mark_idle(now_ns=went_idle)
    decode.run(lambda: None, 0, computed=lambda: False)
    assert prefill.step_threads() == 2
    decode.run(lambda: None, 0, computed=lambda: True)
    assert prefill.step_threads() == 1


def test_a_step_with_nothing_ready_to_compute_never_marks_the_node_busy(board_path, monkeypatch):
    """A push-mode decode node steps while its request waits for the KV its prefill node
    computes. Marked busy during such a step, it lent nothing to the prefill step that began
    meanwhile (that very prompt's): so a step with nothing ready leaves the slot as it is, and
    runs on the node's own share."""
    set_to: list[int] = []
    monkeypatch.setattr("pdserve.node.core_board.set_compute_threads", lambda n: set_to.append(n) or n)
    prefill, decode = CoreBoard(board_path, 0, 1, 2), CoreBoard(board_path, 1, 1, 2)
    decode.mark_idle(now_ns=time.monotonic_ns() - int(LEND_AFTER_S * 1e9))
    seen_during = decode.run(lambda: prefill.step_threads(), 0, computed=lambda: False, ready=False)
    assert seen_during == 2 and prefill.step_threads() == 2 and set_to == [1]
    assert decode.run(lambda: prefill.step_threads(), 0, computed=lambda: False) == 1  # (ready: busy meanwhile)


def test_a_lending_nodes_compiled_kernels_can_take_the_lent_cores():
    """The compiled kernels (the products) run at numba's count, which numba caps at the pool it
    sized at start (NUMBA_NUM_THREADS): a lending node's pool is the machine's, its count its
    share until a step borrows. (Sized to the share, a lent step ran its products on one thread.)"""
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="2")
    code = ("from pdserve.executor.group import set_rank_threads; import numba;"
            "print(set_rank_threads(1), numba.get_num_threads(), set_rank_threads(2), numba.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "1", "2", "2"]
    capped = dict(env, NUMBA_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], env=capped, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "1", "1", "1"]  # what a pool sized to the share allows


def test_from_env_needs_a_board_a_slot_and_a_share(board_path):
    assert CoreBoard.from_env({}) is None
    assert CoreBoard.from_env({"PDSERVE_CORE_BOARD": board_path, "PDSERVE_CORE_SLOT": str(SLOTS),
                               "OMP_NUM_THREADS": "1"}) is None
    board = CoreBoard.from_env({"PDSERVE_CORE_BOARD": board_path, "PDSERVE_CORE_SLOT": "3", "OMP_NUM_THREADS": "1"})
    assert (board.slot, board.share) == (3, 1)


def test_pdserve_up_lends_idle_cores_by_default_and_serves_the_same_tokens():
    pytest.importorskip("openai")
    from pdserve.offline.llm import LLM
    from pdserve.testing.up_cluster import (
        assert_greedy_matches_offline,
        node_pids,
        node_stats,
        running_cluster,
        wait_for,
    )

    llm = LLM("builtin:tiny", num_kv_blocks=512)
    flags = ("--lend-min-prompt-tokens", "100", "--threads-per-node", "1", "--kv-transfer", "nixl")  # lending: the default
    with running_cluster(*flags) as (url, proc):
        for length in (60, 120, 120):  # under the threshold of prompt tokens, then over it
            # Both nodes idle past LEND_AFTER_S first: each prompt's first step then borrows (back
            # to back, on a loaded machine, no node had been idle that long).
            time.sleep(2 * LEND_AFTER_S)
            assert_greedy_matches_offline(url, llm, list(range(length, 2 * length)), 16)
            if length == 60:
                assert sum(s.get("lent_core_steps", 0) for s in node_stats(url).values()) == 0
        wait_for(lambda: sum(s.get("lent_core_steps", 0) for s in node_stats(url).values()) > 0, timeout_s=10)
        # a lent step ran the compiled kernels on both cores, not on the node's one
        assert max(s.get("widest_lent_threads", 0) for s in node_stats(url).values()) == 2
        board = _board_of(node_pids(proc.pid))
        assert board is not None and os.path.exists(board)
    assert not os.path.exists(board)


def test_no_lend_idle_cores_keeps_each_node_on_its_share():
    """--no-lend-idle-cores: no board in the nodes' environments, no lent step, the same tokens."""
    pytest.importorskip("openai")
    from pdserve.offline.llm import LLM
    from pdserve.testing.up_cluster import assert_greedy_matches_offline, node_pids, node_stats, running_cluster

    llm = LLM("builtin:tiny", num_kv_blocks=512)
    flags = ("--no-lend-idle-cores", "--lend-min-prompt-tokens", "100", "--threads-per-node", "1")
    with running_cluster(*flags) as (url, proc):
        time.sleep(2 * LEND_AFTER_S)
        assert_greedy_matches_offline(url, llm, list(range(120, 240)), 16)
        assert sum(s.get("lent_core_steps", 0) for s in node_stats(url).values()) == 0
        assert _board_of(node_pids(proc.pid)) == ""


def _board_of(pids: dict[str, int]) -> str | None:
    """The core board named in the nodes' environments (every node names the same one)."""
    boards = set()
    for name, pid in pids.items():
        if not name.startswith(("prefill-", "decode-")):
            continue
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        boards.add(env.get(b"PDSERVE_CORE_BOARD", b"").decode())
    return boards.pop() if len(boards) == 1 else None
