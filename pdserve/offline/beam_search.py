"""LLM.beam_search's driver: rounds of one-token requests over the offline engine.

Each round every live beam of every prompt is one request, its prompt the prompt plus the beam's
tokens, max_tokens=1 and the top K logprobs (pdserve.protocol.beam_search picks the next beams
from them). The beams of a prompt reach the engine together, so they take the prompt's full
blocks from the prefix cache by reference (the block pool's counts): W beams hold the prompt
once, plus each its own last partial block, recomputed every round (as in vLLM V1).
"""
from __future__ import annotations

import itertools

from pdserve.protocol.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pdserve.protocol.sampling_params import SamplingParams


def run_beam_search(engine, prompts: list[tuple[list[int], str | None]], params: BeamSearchParams,
                    lora_name: str | None = None) -> list[BeamSearchOutput]:
    """prompts: (token ids, cache salt) each. The engine is an LLMEngine with nothing else queued."""
    vocab = engine.model.spec.vocab_size
    for token_ids, _ in prompts:
        if len(token_ids) + params.max_tokens > engine.max_model_len:
            raise ValueError(f"a prompt of {len(token_ids)} tokens plus max_tokens {params.max_tokens} "
                             f"exceeds the model's {engine.max_model_len}")
    searches = [BeamSearch(ids, params, engine.outputs.eos_token_ids, vocab) for ids, _ in prompts]
    ids = itertools.count()
    while not all(s.done for s in searches):
        requests = {}
        for search, (_, salt) in zip(searches, prompts):
            if search.done:
                continue
            for i, beam in enumerate(search.running):
                rid = f"beam-{next(ids)}"
                sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=search.k, ignore_eos=True)
                engine.add_request(rid, search.prompt + beam.tokens, sp, cache_salt=salt, lora_name=lora_name)
                requests[rid] = (search, i)
        tops = _run_round(engine, list(requests))
        for search in {id(s): s for s, _ in requests.values()}.values():
            search.advance([tops[rid] for rid, (s, _) in requests.items() if s is search])
    return [BeamSearchOutput([_sequence(engine, s, score, beam) for score, beam in s.results()])
            for s in searches]


def _run_round(engine, rids: list[str]) -> dict[str, list[tuple[int, float]]]:
    """Steps the engine until each request has its token; their top logprobs."""
    tops: dict[str, list[tuple[int, float]]] = {}
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.error:
                    raise RuntimeError(f"beam request {out.request_id} failed: {out.error}")
                if out.new_logprobs:
                    tops[out.request_id] = out.new_logprobs[0].top
    except BaseException:
        for rid in rids:
            engine.abort_request(rid)
        raise
    return tops


def _sequence(engine, search: BeamSearch, score: float, beam) -> BeamSearchSequence:
    ended_by_eos = bool(beam.tokens) and search.is_eos(beam.tokens[-1])
    shown = beam.tokens[:-1] if ended_by_eos and not search.params.include_stop_str_in_output else beam.tokens
    tokenizer = engine.tokenizer
    text = tokenizer.decode(shown, skip_special_tokens=True) if tokenizer is not None else None
    return BeamSearchSequence(search.prompt + beam.tokens, beam.logprobs, beam.cum_logprob, text,
                              "stop" if ended_by_eos else "length", beam.tokens[-1] if ended_by_eos else None,
                              score)
