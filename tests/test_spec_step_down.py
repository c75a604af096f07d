"""Dynamic speculation (pdserve.spec_decode.step_down): drafting stops at disable_by_batch_size
decoding requests and resumes below it, a request whose drafts are rejected gets fewer (more
so in a larger step), and the output stays token for token that of the same engine without
speculation."""
from __future__ import annotations

import random

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.speculative_config import parse_speculative_config
from pdserve.spec_decode.step_down import StepDown, probe_interval
from pdserve.testing.model_factory import make_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("step_down"), "llama", seed=3)


def _llm(path, spec=None):
    return LLM(str(path), block_size=8, num_kv_blocks=96, speculative_config=spec)


def _prompts(count):
    """Prompts that repeat themselves, so the n-gram lookup finds drafts."""
    rng = random.Random(5)
    out = []
    for _ in range(count):
        p = [rng.randrange(250) for _ in range(12)]
        out.append({"prompt_token_ids": p + p[:6]})
    return out


def _generate(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _record_drafting(llm):
    """Per step: (decoding requests, requests drafted for), by wrapping the speculator."""
    spec, steps = llm.engine.speculator, []
    add = spec.add_drafts

    def add_drafts(batch):
        decoding = sum(1 for _, n in batch.items if n == 1)
        add(batch)
        steps.append((decoding, sum(1 for req, _ in batch.items if req.spec_token_ids)))
    spec.add_drafts = add_drafts
    return steps


def test_disable_by_batch_size_stops_drafting_and_output_is_unchanged(target):
    """Five requests ending at different lengths, threshold 3: no step with 3 or more decoding
    requests drafts, steps with fewer do, and every output equals the engine without it."""
    prompts = _prompts(5)
    params = [SamplingParams(max_tokens=6 + 8 * i, temperature=0) for i in range(5)]
    plain = _generate(_llm(target), prompts, params)
    llm = _llm(target, {**NGRAM, "disable_by_batch_size": 3})
    llm.engine.speculator.step_down.fixed_rows = float("inf")  # the batch rule alone
    steps = _record_drafting(llm)
    assert _generate(llm, prompts, params) == plain
    assert all(drafted == 0 for decoding, drafted in steps if decoding >= 3)
    assert any(decoding >= 3 for decoding, _ in steps)
    assert any(drafted > 0 for decoding, drafted in steps if decoding < 3)
    assert llm.engine.speculator.step_down.steps_disabled > 0
    assert llm.engine.speculator.stats.num_draft_tokens > 0


def test_default_step_down_keeps_greedy_output(target):
    """With the default rule (acceptance and step size) on a batch of random-weight requests,
    whose drafts are mostly rejected: output equal to speculation off, fewer draft tokens than
    drafting k every step, and still some drafts."""
    prompts = _prompts(6)
    params = SamplingParams(max_tokens=32, temperature=0)
    plain = _generate(_llm(target), prompts, params)
    stepped, always = _llm(target, NGRAM), _llm(target, NGRAM)
    always.engine.speculator.step_down.fixed_rows = float("inf")
    for llm in (stepped, always):
        assert _generate(llm, prompts, params) == plain
    s, a = stepped.engine.speculator.stats, always.engine.speculator.stats
    assert 0 < s.num_draft_tokens < a.num_draft_tokens
    assert a.acceptance_rate < 0.5  # (the case the rule is for: drafts mostly rejected)


def test_rule_steps_down_with_rejections_and_step_size():
    """A trusted request drafts k; rejections cut its drafts, more in a step of many rows; a
    request cut to none still probes now and then, more rarely in a large step; an accepted run brings it back."""
    rule = StepDown(k=4)
    assert rule.draft_len("r", rows=1, cap=10) == 4
    assert rule.draft_len("r", rows=1, cap=2) == 2  # (its own limit: max_tokens, model length)
    for _ in range(3):
        rule.record("r", num_drafted=4, num_accepted=1)  # accepted 1 of 2 tried each time
    q = rule.acceptance["r"]
    assert 0.4 < q < 0.8
    small, large = rule.draft_len("r", rows=1, cap=10), rule.draft_len("r", rows=64, cap=10)
    assert small > large
    for _ in range(10):
        rule.record("r", num_drafted=4, num_accepted=0)
    for rows in (1, 64):
        drafts = [rule.draft_len("r", rows=rows, cap=10) for _ in range(2 * probe_interval(rows))]
        assert drafts.count(1) == 2 and set(drafts) == {0, 1}
    assert probe_interval(64) > 10 * probe_interval(1)  # (a probe's row costs more in a large step)
    for _ in range(10):
        rule.record("r", num_drafted=4, num_accepted=4)
    assert rule.draft_len("r", rows=1, cap=10) == 4
    rule.release("r")
    assert "r" not in rule.acceptance and "r" not in rule.idle_steps


def test_disable_by_batch_size_is_checked():
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        parse_speculative_config({**NGRAM, "disable_by_batch_size": 0})
