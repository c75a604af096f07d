"""Suffix decoding (pdserve.spec_decode.suffix): the suffix tree against a brute-force count of
substrings, its drafts against a reference search over the same sequences, the global tree's
bound; through the engine, greedy output equal to the engine without speculation and to
transformers' generate, drafts from the global tree, the step-down applied; served by a 1P1D
cluster through the store, output equal to the offline engine without speculation."""
from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.spec_decode.suffix import SuffixProposer
from pdserve.spec_decode.suffix_tree import SuffixTree, speculate
from pdserve.testing.model_factory import load_reference, make_model

SUFFIX = {"method": "suffix", "num_speculative_tokens": 6}


def _walk(node, prefix, out):
    for token, child in node.children.items():
        out[(*prefix, token)] = child.count
        _walk(child, (*prefix, token), out)
    return out


def _substring_counts(seqs, depth):
    counts = Counter()
    for seq in seqs:
        for i in range(len(seq)):
            for j in range(i + 1, min(len(seq), i + depth) + 1):
                counts[tuple(seq[i:j])] += 1
    return dict(counts)


def _reference_draft(seqs, context, k, factor, min_prob, depth):
    """The best draft by counting occurrences in the sequences directly (no tree), and whether a
    tie between continuations made the choice arbitrary anywhere."""
    counts = _substring_counts(seqs, depth)
    best, tied = ([], 0.0), False
    for length in range(1, min(len(context), depth - 1) + 1):
        pattern = tuple(context[len(context) - length:])
        if pattern not in counts:
            break
        limit = min(k, int(length * factor + 1e-6), depth - length)
        path, prob, score = list(pattern), 1.0, 0.0
        while len(path) - length < limit:
            nexts = {s[-1]: c for s, c in counts.items() if len(s) == len(path) + 1 and list(s[:-1]) == path}
            if not nexts:
                break
            top = max(nexts.values())
            tied |= sum(c == top for c in nexts.values()) > 1
            prob *= top / counts[tuple(path)]
            if prob < min_prob:
                break
            path.append(next(t for t, c in nexts.items() if c == top))
            score += prob
        draft = path[length:]
        if draft and score >= best[1]:
            best = (draft, score)
    return best, tied


def test_tree_counts_every_substring_and_removal_undoes_it():
    rng = random.Random(1)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(5, 40))] for _ in range(5)]
    tree = SuffixTree(6)
    for seq in seqs:
        tree.add(seq)
    assert _walk(tree.root, (), {}) == _substring_counts(seqs, 6)
    for seq in seqs[:3]:
        tree.remove(seq)
    assert _walk(tree.root, (), {}) == _substring_counts(seqs[3:], 6)
    for seq in seqs[3:]:
        tree.remove(seq)
    assert not tree.root.children and tree.root.count == 0


@pytest.mark.parametrize("factor, min_prob", [(1.0, 0.1), (0.5, 0.3), (2.0, 0.0)])
def test_drafts_equal_a_reference_search(factor, min_prob):
    """Drafts from the tree's matches equal a search that counts substrings directly (where no
    two continuations tie in count: which one wins a tie is arbitrary)."""
    rng = random.Random(2)
    checked = 0
    for _ in range(200):
        seqs = [[rng.randrange(6) for _ in range(rng.randrange(8, 30))] for _ in range(3)]
        context = seqs[0][:rng.randrange(3, len(seqs[0]))]
        tree = SuffixTree(8)
        for seq in seqs:
            tree.add(seq)
        got = speculate(tree.match(context), 5, factor, min_prob, 8)
        want, tied = _reference_draft(seqs, context, 5, factor, min_prob, 8)
        if not tied:
            assert got[0] == want[0] and got[1] == pytest.approx(want[1])
            checked += 1
    assert checked >= 20


def test_global_tree_is_bounded():
    proposer = SuffixProposer(depth=8, max_cached_requests=2, max_spec_factor=1.0, min_token_prob=0.1)
    from pdserve.engine.request import Request
    outputs = []
    for i in range(5):
        req = Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=20))
        proposer.propose(req, 4)
        for t in range(10):
            req.append_output(10 * i + t)
        outputs.append(req.output_token_ids)
        proposer.release(req.request_id)
    assert not proposer.local and list(proposer.cached) == outputs[-2:]
    assert _walk(proposer.global_tree.root, (), {}) == _substring_counts(outputs[-2:], 8)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("suffix"), "llama", seed=3)


@pytest.fixture(scope="module")
def plain(target):
    return LLM(str(target), block_size=8, num_kv_blocks=96)


def _prompts(seed, lengths):
    rng = random.Random(seed)
    out = []
    for n in lengths:
        p = [rng.randrange(250) for _ in range(n)]
        out.append(p + p[: n // 2])  # a repeat: the request's own tree matches it
    return out


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_equals_plain_engine_and_transformers(target, plain):
    """Requests that speculate beside ones that cannot (a penalty, logprobs): equal to the engine
    without speculation, the greedy ones to transformers; drafts accepted and rejected, the
    step-down in force (suffix keeps no KV), every block back in the pool."""
    llm = LLM(str(target), block_size=8, num_kv_blocks=96, speculative_config=SUFFIX)
    prompts = _prompts(4, (6, 14, 22, 30))
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    params = [greedy, greedy, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=1.3)]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    assert _ids(llm.generate(inputs, params, use_tqdm=False)) == _ids(plain.generate(inputs, params, use_tqdm=False))
    ref = load_reference(target)
    for prompt, out in zip(prompts[:2], llm.generate(inputs[:2], greedy, use_tqdm=False)):
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt):]
        assert out.outputs[0].token_ids == want.tolist()
    spec = llm.engine.speculator
    assert 0 < spec.stats.num_accepted_tokens < spec.stats.num_draft_tokens
    assert spec.step_down.fixed_rows != float("inf")
    assert not llm.engine.has_unfinished_requests() and llm.engine.pool.num_free == llm.engine.pool.num_blocks
    assert not spec.proposer.local and spec.proposer.cached  # trees gone, outputs kept


def test_global_tree_drafts_what_another_request_wrote(target, plain):
    """A request whose answer another request produced before (the same prompt after a different
    preamble): its own tree has not seen the answer, the global tree has, and drafts from it."""
    rng = random.Random(7)
    body = [rng.randrange(250) for _ in range(12)]
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    llm = LLM(str(target), block_size=8, num_kv_blocks=96, speculative_config={**SUFFIX, "num_speculative_tokens": 8})
    first = llm.generate({"prompt_token_ids": [5, *body]}, greedy, use_tqdm=False)
    proposer = llm.engine.speculator.proposer
    assert proposer.global_wins == 0
    second = llm.generate({"prompt_token_ids": [9, *body]}, greedy, use_tqdm=False)
    want = plain.generate([{"prompt_token_ids": [5, *body]}, {"prompt_token_ids": [9, *body]}], greedy, use_tqdm=False)
    assert _ids(first + second) == _ids(want)
    assert proposer.global_wins > 0


@pytest.mark.parametrize("config, message", [
    ({"method": "suffix", "model": "x"}, "takes no model"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 1}, "max_tree_depth"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 2}, "min_token_prob"),
    ({"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 8}, "keys of method suffix"),
])
def test_bad_suffix_config_is_refused_at_start(config, message):
    with pytest.raises(ValueError, match=message):
        LLM("builtin:tiny", num_kv_blocks=16, speculative_config=config)


def test_vllm_spelling_defaults_k_to_the_tree_depth():
    from pdserve.engine.speculative_config import parse_speculative_config
    assert parse_speculative_config('{"method": "suffix"}').num_speculative_tokens == 24
    assert parse_speculative_config(
        {"method": "suffix", "suffix_decoding_max_tree_depth": 12}).num_speculative_tokens == 12


def test_served_1p1d_over_the_store_equals_offline():
    """The decode node builds each request's tree from the prompt the handover carries: greedy
    output through the router equals the offline engine without speculation, and the decode
    node's drafts (how many, how long, how many accepted) are the offline engine's with the same
    suffix config. builtin:tiny's random weights accept drafts on some CPUs' rounding and none on
    others (an AVX-512 EPYC: 0 of 21), so the test counts against that reference, not against 0."""
    import openai

    from pdserve.spec_decode.speculator import spec_stats
    from pdserve.testing.up_cluster import node_stats, running_clusters, wait_for
    prompts = ["one two three four five one two three four five one two", "abcabcabcabc " * 4]
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    want = LLM("builtin:tiny", num_kv_blocks=256).generate(prompts, greedy, use_tqdm=False)
    offline = LLM("builtin:tiny", num_kv_blocks=256, speculative_config=SUFFIX)
    for prompt in prompts:  # one at a time, as the client sends them: the same trees, the global one too
        offline.generate([prompt], greedy, use_tqdm=False)
    drafted = {k: v for k, v in spec_stats(offline.engine).items() if k.startswith("spec_num")}
    assert drafted["spec_num_drafts"] > 0
    flags = ("--kv-transfer", "store", "--num-kv-blocks", "256", "--speculative-config", json.dumps(SUFFIX))
    with running_clusters(flags) as [(url, _)]:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        for prompt, ref in zip(prompts, want):
            r = client.completions.create(model="builtin:tiny", prompt=prompt, max_tokens=48, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
            assert r.choices[0].model_extra["token_ids"] == ref.outputs[0].token_ids
            assert r.choices[0].text == ref.outputs[0].text

        def decode_drafts():  # as of the decode node's last pong (every 0.2 s)
            stats = next(s for s in node_stats(url).values() if s["role"] == "decode")
            return {k: stats.get(k) for k in drafted}
        try:
            wait_for(lambda: decode_drafts() == drafted)
        except AssertionError:
            assert decode_drafts() == drafted
