"""`pdserve bench --trace`: Mooncake traces read, scaled and turned into prompts that share exactly
what their hash ids share, in any process; conversations found; the cache bounds right on small
traces whose answer is known by hand; and a replay of the repository's slice against a real
`pdserve up`."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.loadgen.cache_bound import BlockRequest, infinite_cache_share, optimal_cache_share
from pdserve.loadgen.cli import main as bench_main
from pdserve.loadgen.trace import TraceRequest, TraceScale, conversations, full_block_keys, prompt_token_ids, read_trace
from pdserve.loadgen.trace_replay import plan_replay

TRACES = Path(__file__).resolve().parent.parent / "benchmarks" / "traces"
CONVERSATION = TRACES / "mooncake_conversation_300.jsonl"
SYNTHETIC = TRACES / "mooncake_synthetic_300.jsonl"


def _req(ids, input_length=None, ts=0.0, out=8):
    return TraceRequest(ts, input_length or 512 * len(ids), out, tuple(ids))


def test_the_slices_read_whole():
    for path in (CONVERSATION, SYNTHETIC):
        requests = read_trace(path)
        assert len(requests) == 300
        assert all(r.hash_ids and r.input_length <= 512 * len(r.hash_ids) for r in requests)


def test_a_malformed_line_names_its_place(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a trace line"):
        read_trace(bad)


@pytest.mark.parametrize("path", [CONVERSATION, SYNTHETIC])
def test_prompt_blocks_are_equal_exactly_where_hash_ids_are(path):
    scale = TraceScale(length_divisor=16)
    requests = read_trace(path)[:120]
    prompts = [prompt_token_ids(r, scale, seed=3, low=100, high=30000, index=i) for i, r in enumerate(requests)]
    b, pairs_sharing = scale.block_tokens, 0
    for i in range(len(requests)):
        assert len(prompts[i]) == scale.input_len(requests[i])
        for j in range(i):
            for k in range(min(len(prompts[i]), len(prompts[j])) // b):
                same_id = requests[i].hash_ids[k] == requests[j].hash_ids[k]
                assert (prompts[i][k * b:(k + 1) * b] == prompts[j][k * b:(k + 1) * b]) == same_id
                pairs_sharing += same_id
    assert pairs_sharing > 100  # the slice does share prefixes (the system prompt's block at least)


PROMPT_DIGEST = """
from pdserve.loadgen.trace import TraceScale, prompt_token_ids, read_trace
import hashlib, sys
scale = TraceScale(length_divisor=8)
ids = [prompt_token_ids(r, scale, 7, 100, 30000, i) for i, r in enumerate(read_trace(sys.argv[1])[:50])]
print(hashlib.sha256(repr(ids).encode()).hexdigest())
"""


def test_prompts_are_the_same_in_every_process():
    digests = {subprocess.run([sys.executable, "-c", PROMPT_DIGEST, str(CONVERSATION)], capture_output=True,
                              text=True, check=True, env={"PYTHONHASHSEED": seed}).stdout.strip()
               for seed in ("1", "2")}
    scale = TraceScale(length_divisor=8)
    here = [prompt_token_ids(r, scale, 7, 100, 30000, i) for i, r in enumerate(read_trace(CONVERSATION)[:50])]
    assert digests == {hashlib.sha256(repr(here).encode()).hexdigest()}


def test_scaling_lengths_outputs_and_window():
    scale = TraceScale(length_divisor=4, output_divisor=3, output_cap=10, start_s=1.0, duration_s=2.0,
                       max_requests=2)
    req = _req([1, 2, 3], input_length=1300, out=40)
    assert scale.block_tokens == 128 and scale.input_len(req) == 325 and scale.output_len(req) == 10
    assert full_block_keys(req, scale) == [1, 2]  # 325 tokens: two full blocks of 128 and a partial one
    requests = [_req([i], ts=ms) for i, ms in enumerate((0, 900, 1000, 2500, 2999, 3000))]
    assert [r.hash_ids[0] for r in scale.select(requests)] == [2, 3]
    with pytest.raises(ValueError):
        TraceScale(length_divisor=3)


def test_conversations_chain_turns_that_resend_the_history():
    requests = [
        _req([0, 1, 2], ts=0),        # conversation A, turn 1 (its last block partial)
        _req([0, 5, 6], ts=10),       # conversation B: shares only the system prompt's block with A
        _req([0, 1, 7, 8], ts=20),    # A, turn 2: A's full blocks [0, 1] lead
        _req([0, 5, 9], ts=30),       # B, turn 2
        _req([0, 1, 7, 10], ts=40),   # A, turn 3
        _req([0, 1, 11], ts=50),      # a new conversation: [0, 1] was continued already
    ]
    assert conversations(requests) == [[0, 2, 4], [1, 3], [5]]


def _blocks(*keys_lists, block=10):
    return [BlockRequest(tuple(keys), block * len(keys)) for keys in keys_lists]


def test_bounds_on_traces_whose_answer_is_known():
    requests = _blocks([1, 2], [3], [1, 2])
    assert infinite_cache_share(requests, 10) == pytest.approx(20 / 50)
    # Two blocks fit: Belady keeps 1 and 2 (used again) and never keeps 3 (never used again).
    assert optimal_cache_share(requests, 10, capacity_tokens=20) == pytest.approx(20 / 50)
    # One block fits: the deeper of the tied pair goes, so 1 stays and serves the third request.
    assert optimal_cache_share(requests, 10, capacity_tokens=10) == pytest.approx(10 / 50)
    assert optimal_cache_share(requests, 10, capacity_tokens=9) == 0.0
    # Two blocks cannot keep both [4] and [1, 2]: at best 20 of the 30 reused tokens (block 4 and
    # block 1, or blocks 1 and 2); three blocks keep all 30, as the infinite cache does.
    seq = _blocks([1, 2], [4], [5], [4], [1, 2])
    assert optimal_cache_share(seq, 10, capacity_tokens=20) == pytest.approx(20 / 70)
    assert optimal_cache_share(seq, 10, capacity_tokens=30) == pytest.approx(30 / 70)
    assert infinite_cache_share(seq, 10) == pytest.approx(30 / 70)


def test_the_optimal_bound_grows_with_capacity_up_to_the_infinite_one():
    plan = plan_replay(str(CONVERSATION), TraceScale(length_divisor=16), seed=0, low=100, high=30000)
    shares = [plan.cache_bounds(cap)["cache_bound_optimal"] for cap in (0, 512, 2048, 8192, 10 ** 9)]
    assert shares == sorted(shares) and shares[0] == 0.0
    assert shares[-1] == pytest.approx(plan.cache_bounds(None)["cache_bound_infinite"]) and shares[-1] > 0.05


def test_replay_against_pdserve_up(tmp_path, capsys, store_cluster):
    out = tmp_path / "trace.json"
    code = bench_main(["--base-url", store_cluster, "--trace", str(CONVERSATION), "--trace-length-divisor", "32",
                       "--trace-output-cap", "4", "--trace-max-requests", "16", "--trace-time-scale", "0.02",
                       "--max-token-id", "250", "--cache-capacity-tokens", "4096", "--num-warmup", "0",
                       "--disable-tqdm", "--output-json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["completed"] == 16 and report["failed"] == 0
    assert report["config"]["workload"] == "trace" and report["trace_block_tokens"] == 16
    assert 0 < report["cache_bound_optimal"] <= report["cache_bound_infinite"] <= 1
    # The slice's requests open with the same system prompt block: the server serves some from cache.
    assert report["cached_token_share"] is not None and report["cached_token_share"] > 0
    assert "cache_bound_infinite" in capsys.readouterr().out
