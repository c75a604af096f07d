"""LLM.beam_search equals transformers' generate(num_beams=W, num_return_sequences=W) on
random-weight checkpoints: the same beams in the same order, their sequences_scores and their
cumulative logprobs, for W = 2 and 4, with EOS reachable, across length penalties and the three
early_stopping settings. The beams of a prompt hold its blocks once (the block pool's count),
and every block is released after."""
from __future__ import annotations

import json
import random
import shutil

import pytest

from pdserve import LLM, BeamSearchParams
from pdserve.protocol.beam_search import BeamSearch
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.testing.beam_reference import assert_beams_match, reference_beams
from pdserve.testing.model_factory import load_reference, make_model

BYTE_EOS = 257  # the byte tokenizer's EOS, which the random models generate often


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("beam_models")
    built = {kind: make_model(root, kind) for kind in ("llama", "qwen2")}
    # qwen2 with a second EOS id that its beams generate early, so hypotheses finish mid-search
    # and each round asks for 3W candidates (transformers keeps (1 + #EOS) * W).
    early = root / "qwen2-eos"
    shutil.copytree(built["qwen2"], early)
    config = json.loads((early / "config.json").read_text())
    config["eos_token_id"] = [EARLY_EOS, BYTE_EOS]
    (early / "config.json").write_text(json.dumps(config))
    built["qwen2-eos"] = early
    return {kind: (LLM(str(path)), load_reference(path)) for kind, path in built.items()}


EARLY_EOS = 230  # the 8th token of qwen2's best beam on PROMPT


def _prompt(seed: int = 1, n: int = 20) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]


PROMPT = _prompt()

CASES = [  # model, W, max_tokens, length_penalty, early_stopping, ignore_eos
    ("llama", 2, 8, 1.0, False, True),
    ("llama", 4, 8, 1.0, False, False),
    ("llama", 2, 10, 0.5, True, False),
    ("llama", 4, 16, 1.0, True, False),
    ("llama", 4, 12, 1.0, "never", False),
    ("qwen2", 4, 12, 2.0, "never", False),
    ("qwen2", 4, 12, -1.0, False, False),
    ("qwen2", 2, 12, 1.0, False, False),
    ("qwen2-eos", 4, 12, 1.0, False, False),
    ("qwen2-eos", 2, 12, 0.0, "never", False),
]


@pytest.mark.parametrize("kind,width,max_tokens,length_penalty,early_stopping,ignore_eos", CASES)
def test_beams_equal_transformers(models, kind, width, max_tokens, length_penalty, early_stopping, ignore_eos):
    llm, ref = models[kind]
    params = BeamSearchParams(width, max_tokens, ignore_eos=ignore_eos, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    ours = llm.beam_search([{"prompt_token_ids": PROMPT}], params)[0]
    eos = None if ignore_eos else sorted(llm.engine.outputs.eos_token_ids)
    want = reference_beams(ref, PROMPT, width, max_tokens, length_penalty, early_stopping, eos)
    assert_beams_match(ours, want, len(PROMPT))
    assert len(ours.sequences) == width
    assert llm.engine.pool.num_used == 0
    if kind == "qwen2-eos":  # (the case is meant to finish hypotheses early)
        assert any(s.finish_reason == "stop" and s.tokens[-1] == EARLY_EOS for s in ours.sequences)


def test_several_prompts_at_once(models):
    llm, ref = models["llama"]
    prompts = [_prompt(seed, n) for seed, n in ((2, 9), (3, 33), (4, 17))]
    params = BeamSearchParams(4, 10)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    eos = sorted(llm.engine.outputs.eos_token_ids)
    for prompt, ours in zip(prompts, outs):
        assert_beams_match(ours, reference_beams(ref, prompt, 4, 10, eos_token_ids=eos), len(prompt))


def test_beams_share_prompt_blocks(models):
    """During a round the W beams hold the prompt's full blocks once: the pool's peak use is the
    prompt's blocks plus a few per beam, not W prompts."""
    llm, _ = models["llama"]
    engine, bs = llm.engine, llm.engine.config.block_size
    prompt = _prompt(5, 8 * bs)
    peak = _peak_blocks(engine, lambda: llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(4, 6)))
    single = _peak_blocks(engine, lambda: llm.generate([{"prompt_token_ids": prompt}],
                                                       SamplingParams(max_tokens=6), use_tqdm=False))
    assert single == 9
    assert peak <= 8 + 4 * 2 < 4 * 8, peak
    assert engine.pool.num_used == 0


def _peak_blocks(engine, run) -> int:
    peak, step = 0, engine.step

    def counting_step():
        nonlocal peak
        peak = max(peak, engine.pool.num_used)  # (scheduled last step, still held)
        out = step()
        peak = max(peak, engine.pool.num_used)
        return out
    engine.step = counting_step
    try:
        run()
    finally:
        del engine.step
    return peak


def test_text_and_sequence_fields(models):
    llm, _ = models["llama"]
    out = llm.beam_search(["The cat"], BeamSearchParams(2, 8))[0]
    prompt_ids = llm.get_tokenizer()("The cat")["input_ids"]
    for seq in out.sequences:
        assert seq.tokens[:len(prompt_ids)] == prompt_ids
        generated = seq.tokens[len(prompt_ids):]
        assert len(seq.logprobs) == len(generated)
        assert all(tok in top for tok, top in zip(generated, seq.logprobs))
        assert abs(sum(top[t] for t, top in zip(generated, seq.logprobs)) - seq.cum_logprob) < 1e-4
        shown = generated[:-1] if seq.finish_reason == "stop" else generated
        assert seq.text == llm.get_tokenizer().decode(shown, skip_special_tokens=True)


def test_params_refused():
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(2, 4, temperature=0.5)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(2, 4, early_stopping="sometimes")
    with pytest.raises(ValueError, match="top 24 logprobs"):
        BeamSearch([1, 2], BeamSearchParams(8, 4), {257, 5})
