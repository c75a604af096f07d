"""Per-request logits edits, batched: bad words, min_tokens, logit_bias and the penalties.

State comes from each request's own token lists (prompt, generated), never from anything the
engine accumulated, so a decode node that receives prompt + first token (or, after a failover,
prompt + every relayed token) applies exactly what the node before it would have.

Order follows vLLM: bad words, min_tokens, logit_bias, then the penalties. Formulas:
  * repetition_penalty (HF's RepetitionPenaltyLogitsProcessor), over prompt and generated
    tokens: a seen token's logit l becomes l / p when l > 0, else l * p.
  * frequency_penalty / presence_penalty (OpenAI's), over generated tokens:
    l[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty, c[j]: count of j so far.
Rows with none of these are not touched, and a batch without any costs one list scan.

A repetition penalty near 0 (any p > 0 is accepted, as in vLLM) divides a positive logit into
float32 overflow; such a logit saturates at LOGIT_LIMIT instead of becoming inf, whose softmax
is NaN. The limit stays finite after the smallest sampling temperature (1e-5) divides it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

LOGIT_LIMIT = 1e30


class TokenHistory(Protocol):
    """What a processor reads of a request (engine.request.Request has it)."""
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    all_token_ids: list[int]
    sampling_params: object


def apply_logits_processors(logits: torch.Tensor, requests: Sequence[TokenHistory],
                            stop_token_ids: set[int]) -> None:
    """Edits logits [B, vocab] in place; row i belongs to requests[i]."""
    rows = [i for i, r in enumerate(requests) if r.sampling_params.has_logits_processors]
    if not rows:
        return
    banned = _banned_tokens(logits, rows, requests, stop_token_ids)
    if banned:
        r, t = zip(*banned)
        logits[torch.tensor(r, device=logits.device), torch.tensor(t, device=logits.device)] = float("-inf")
    _add_logit_bias(logits, rows, requests)
    penalised = [i for i in rows if _has_penalty(requests[i].sampling_params)]
    if penalised:
        _penalise(logits, penalised, requests)


def _banned_tokens(logits: torch.Tensor, rows: list[int], requests: Sequence[TokenHistory],
                   stop_token_ids: set[int]) -> list[tuple[int, int]]:
    """(row, token) pairs that must not be drawn: the last token of a bad word whose other
    tokens were just produced, and EOS/stop tokens while min_tokens is not reached."""
    vocab = logits.shape[-1]
    out: list[tuple[int, int]] = []
    for i in rows:
        req = requests[i]
        params = req.sampling_params
        if len(req.output_token_ids) < params.min_tokens:
            out += [(i, t) for t in stop_token_ids | set(params.stop_token_ids) if 0 <= t < vocab]
        history = req.all_token_ids
        for word in params.bad_words_token_ids:
            prefix = word[:-1]
            if not prefix or history[len(history) - len(prefix):] == prefix:
                out.append((i, word[-1]))
    return out


def _add_logit_bias(logits: torch.Tensor, rows: list[int], requests: Sequence[TokenHistory]) -> None:
    r, t, v = [], [], []
    for i in rows:
        for token, bias in requests[i].sampling_params.logit_bias.items():
            r.append(i)
            t.append(token)
            v.append(bias)
    if r:
        device = logits.device
        logits.index_put_((torch.tensor(r, device=device), torch.tensor(t, device=device)),
                          torch.tensor(v, dtype=logits.dtype, device=device), accumulate=True)


def _has_penalty(params) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0)


def _flat_ids(rows: list[int], sequences: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Positions in the flattened logits of each row's tokens (row * vocab + token)."""
    flat = [row * vocab + token for row, seq in zip(rows, sequences) for token in seq]
    return torch.tensor(flat, dtype=torch.long, device=device)


def _penalise(logits: torch.Tensor, rows: list[int], requests: Sequence[TokenHistory]) -> None:
    """Sparse and in place: only the (row, token) entries that occurred are read and written,
    so the cost follows the number of tokens so far, not the vocabulary."""
    vocab, device, dtype = logits.shape[-1], logits.device, logits.dtype
    reqs = [requests[i] for i in rows]
    params = [r.sampling_params for r in reqs]
    repeat = any(p.repetition_penalty != 1.0 for p in params)
    outputs = _flat_ids(rows, [r.output_token_ids for r in reqs], vocab, device)
    # Entries to edit: every token so far when a repetition penalty applies (prompt tokens
    # included), else the generated ones.
    keys = torch.unique(_flat_ids(rows, [r.all_token_ids for r in reqs], vocab, device) if repeat else outputs)
    out_keys, out_counts = torch.unique(outputs, return_counts=True)
    counts = torch.zeros(keys.shape, dtype=dtype, device=device)
    counts[torch.searchsorted(keys, out_keys)] = out_counts.to(dtype)
    row_of_key = torch.searchsorted(torch.tensor(rows, device=device), keys // vocab)

    def per_key(name: str) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=device)[row_of_key]

    flat = logits.view(-1)  # logits are contiguous [B, vocab]: a view, so writes land in place
    values = flat[keys]
    if repeat:
        factor = per_key("repetition_penalty")
        values = torch.where(values > 0, (values / factor).clamp(max=LOGIT_LIMIT), values * factor)
    flat[keys] = values - per_key("frequency_penalty") * counts - per_key("presence_penalty") * (counts > 0).to(dtype)
