"""transformers' beam search as the reference for pdserve's (tests/test_beam_search.py and the
cluster test): its beams, their sequences_scores and their cumulative logprobs."""
from __future__ import annotations

import torch

from pdserve.protocol.beam_search import BeamSearchOutput


def reference_beams(ref, prompt: list[int], width: int, max_tokens: int, length_penalty: float = 1.0,
                    early_stopping: bool | str = False, eos_token_ids: list[int] | None = None
                    ) -> list[tuple[list[int], float, float]]:
    """(generated tokens, sequences_score, cumulative logprob) of each of the width beams that
    ref.generate returns, best first. eos_token_ids None: no EOS (ignore_eos)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                           max_new_tokens=max_tokens, length_penalty=length_penalty, early_stopping=early_stopping,
                           do_sample=False, output_scores=True, return_dict_in_generate=True,
                           eos_token_id=eos_token_ids, pad_token_id=0)
        steps = ref.compute_transition_scores(out.sequences, out.scores, out.beam_indices)
    beams = []
    for i in range(width):
        length = int((out.beam_indices[i] >= 0).sum())  # (the rest is padding)
        tokens = out.sequences[i, len(prompt):len(prompt) + length].tolist()
        beams.append((tokens, float(out.sequences_scores[i]), float(steps[i, :length].sum())))
    return beams


def assert_beams_match(ours: BeamSearchOutput, want: list[tuple[list[int], float, float]], prompt_len: int,
                       tol: float = 1e-3) -> None:
    """The same beams in the same order, with scores and cumulative logprobs within tol."""
    got = [(s.tokens[prompt_len:], s.score, s.cum_logprob) for s in ours.sequences]
    assert [g[0] for g in got] == [w[0] for w in want], f"beams differ:\nours {got}\nwant {want}"
    for (_, score, cum), (_, want_score, want_cum) in zip(got, want):
        assert abs(score - want_score) < tol and abs(cum - want_cum) < tol, f"ours {got}\nwant {want}"
