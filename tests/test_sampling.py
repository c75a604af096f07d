"""Sampling behaviour per request, checked against the model's own logits."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM("builtin:tiny", num_kv_blocks=128)


PROMPT = {"prompt_token_ids": list(range(30, 70))}


def _tokens(llm, params, prompt=PROMPT):
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


def test_seed_reproducible_and_per_request(llm):
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 1, 2)]
    outs = llm.generate([PROMPT] * 3, params, use_tqdm=False)
    a, b, c = (o.outputs[0].token_ids for o in outs)
    assert a == b, "same seed in one batch must give the same tokens"
    assert a != c, "different seeds should differ"
    again = _tokens(llm, params[0]).token_ids
    assert again == a, "a seed must reproduce across batches"


def test_top_k_one_is_greedy_and_top_k_limits_support(llm):
    greedy = _tokens(llm, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)).token_ids
    top1 = _tokens(llm, SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=3, ignore_eos=True)).token_ids
    assert top1 == greedy
    logits = llm.engine.prompt_logits(PROMPT["prompt_token_ids"])[-1]
    top3 = set(logits.topk(3).indices.tolist())
    firsts = {_tokens(llm, SamplingParams(max_tokens=1, temperature=5.0, top_k=3, seed=s)).token_ids[0]
              for s in range(40)}
    assert firsts <= top3 and len(firsts) >= 2


def test_top_p_and_min_p_limit_support(llm):
    logits = llm.engine.prompt_logits(PROMPT["prompt_token_ids"])[-1]
    probs = logits.softmax(-1)
    ordered = probs.sort(descending=True)
    nucleus = set(ordered.indices[:int((ordered.values.cumsum(0) < 0.9).sum()) + 1].tolist())
    above = set((probs >= 0.2 * probs.max()).nonzero().flatten().tolist())
    for s in range(30):
        tp = _tokens(llm, SamplingParams(max_tokens=1, top_p=0.9, seed=s)).token_ids[0]
        mp = _tokens(llm, SamplingParams(max_tokens=1, min_p=0.2, seed=s)).token_ids[0]
        assert tp in nucleus and mp in above


def test_logprobs_match_reference_log_softmax(llm):
    out = _tokens(llm, SamplingParams(max_tokens=3, temperature=0, logprobs=3, ignore_eos=True))
    ids = PROMPT["prompt_token_ids"] + out.token_ids
    ref = torch.log_softmax(llm.engine.prompt_logits(ids), dim=-1)
    n = len(PROMPT["prompt_token_ids"])
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[n - 1 + i]
        assert lp.token_id == tok and abs(lp.logprob - row[tok].item()) < 1e-4
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()


def test_stop_token_ids_stop_strings_and_max_tokens(llm):
    greedy = _tokens(llm, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    stop_id = greedy.token_ids[4]
    first_at = greedy.token_ids.index(stop_id)
    by_id = _tokens(llm, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop_id]))
    assert by_id.token_ids == greedy.token_ids[:first_at + 1] and by_id.finish_reason == "stop"
    tok = llm.get_tokenizer()
    text = "".join(tok.decode([t]) for t in greedy.token_ids)
    stop = greedy.text[3:5]
    assert stop, text
    by_str = _tokens(llm, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]))
    assert by_str.finish_reason == "stop" and by_str.text == greedy.text[:greedy.text.index(stop)]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 12


def test_mixed_batch_keeps_greedy_rows_greedy(llm):
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    alone = _tokens(llm, greedy).token_ids
    mixed = llm.generate([PROMPT, PROMPT], [greedy, SamplingParams(max_tokens=8, seed=9, ignore_eos=True)],
                         use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone


def test_logit_bias_and_penalties_shape_random_draws(llm):
    """The edits act before temperature and the filters: on the random path too, a -100 bias
    removes the likeliest tokens and a +100 bias forces one; penalised draws stay seeded."""
    logits = llm.engine.prompt_logits(PROMPT["prompt_token_ids"])[-1]
    top = logits.topk(5).indices.tolist()
    banned = SamplingParams(max_tokens=1, temperature=0.7, logit_bias={t: -100.0 for t in top})
    assert all(_tokens(llm, dataclasses.replace(banned, seed=s)).token_ids[0] not in top for s in range(20))
    forced = SamplingParams(max_tokens=4, temperature=1.5, seed=1, logit_bias={77: 100.0}, ignore_eos=True)
    assert _tokens(llm, forced).token_ids == [77] * 4
    penalised = SamplingParams(max_tokens=12, temperature=1.0, seed=4, presence_penalty=2.0, frequency_penalty=2.0,
                               repetition_penalty=2.0, ignore_eos=True)
    a, b = (_tokens(llm, penalised).token_ids for _ in range(2))
    assert a == b and len(set(a)) == len(a), "strong penalties on a seeded draw: reproducible, no repeats"


def test_greedy_tokens_are_argmax_ties_included():
    """The sampler's greedy pick (max's indices on CPU, faster than argmax) is argmax's token:
    the first of tied maxima, on rows with ties at the ends and everywhere."""
    from pdserve.engine.sampler import greedy_tokens
    logits = torch.randn(64, 49152, generator=torch.Generator().manual_seed(0)).round(decimals=1)
    logits[0] = 3.0
    logits[1, [7, 49151]] = 100.0
    logits[2, [0, 49151]] = 100.0
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    assert greedy_tokens(logits)[:3].tolist() == [0, 7, 0]


def test_compiled_argmax_is_torch_max_on_ties_tails_infinities_and_nans():
    """greedy_tokens' CPU path, the compiled library's argmax (native_rows.argmax_rows), picks what
    torch's max(dim=-1).indices picks: the first of tied maxima (within a 16-wide vector, across
    vectors, in a tail past the last whole 16), on all -inf rows, +inf, mixed signed zeros, and
    rows that are strided views; a row holding a NaN goes back to torch (NaN's index)."""
    from pdserve.engine.sampler import greedy_tokens
    from pdserve.kernels import dequant_tiles, native_gemv, native_rows
    if native_gemv.library() is None or "avx512f" not in dequant_tiles._cpu_flags():
        pytest.skip("the compiled argmax needs the library and AVX-512")
    for cols in (5, 16, 33, 49152, 49157):
        wide = torch.randn(9, cols + 3, generator=torch.Generator().manual_seed(cols)).round(decimals=1)
        wide[0] = float("-inf")
        wide[1, cols - 1] = float("inf")
        wide[2, [1, cols - 1]] = 50.0  # a tie whose second is in the tail
        wide[3] = 0.0
        wide[3, ::2] = -0.0
        wide[4, [cols // 2, cols - 2]] = 50.0
        wide[5, cols:] = 1e9  # past the view's columns: never picked
        logits = wide[:, :cols]
        native = native_rows.argmax_rows(logits)
        assert native is not None and torch.equal(native, logits.max(dim=-1).indices), cols
        assert torch.equal(greedy_tokens(logits), logits.max(dim=-1).indices)
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1))
    logits[2, 40] = float("nan")
    assert native_rows.argmax_rows(logits) is None
    assert greedy_tokens(logits).tolist() == logits.max(dim=-1).indices.tolist()
    assert greedy_tokens(logits)[2].item() == 40
