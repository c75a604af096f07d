"""Prompt logprobs: each prompt token's logprob given the tokens before it, with the top-k.

They are computed where the prompt is computed, from the hidden states of the chunk just run:
the logits at position p give the logprob of prompt token p + 1. A request that asks for them
takes no prefix-cache hits (a cached block has KV but no logits), so every position passes
through here once; they travel out with the request's first token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.request import Request
from pdserve.protocol.outputs import TokenLogprob

# Rows turned into logits at once: bounds the [rows, vocab] float32 buffer of a long chunk.
ROWS_PER_PASS = 256


@dataclass
class PromptSpan:
    """Positions [start, end) of req's prompt computed this step, at hidden rows from `row`."""
    req: Request
    row: int
    start: int
    end: int


def wants_prompt_logprobs(req: Request) -> bool:
    # Once the first token is out its prompt logprobs went with it: a recompute after a
    # preemption, or a node continuing a generation, has none left to report.
    return req.sampling_params.prompt_logprobs is not None and not req.output_token_ids


def prompt_spans(items: list[tuple[Request, int]]) -> list[PromptSpan]:
    """Spans of this step's rows whose next token is a prompt token, for requests that want
    prompt logprobs. items: (request, new tokens) in the order their rows are laid out."""
    spans, row = [], 0
    for req, n in items:
        if wants_prompt_logprobs(req):
            start = req.num_computed_tokens
            end = min(start + n, req.num_prompt_tokens - 1)  # the last prompt position predicts output
            if end > start:
                spans.append(PromptSpan(req, row, start, end))
        row += n
    return spans


def span_passes(spans: list[PromptSpan]):
    """(span, first, last): the prompt positions [first, last) turned into logits in one pass,
    in the order record_prompt_logprobs runs them (a tensor-parallel worker runs the same
    passes, each one a collective; see pdserve.executor)."""
    for span in spans:
        for first in range(span.start, span.end, ROWS_PER_PASS):
            yield span, first, min(first + ROWS_PER_PASS, span.end)


def pass_rows(span: PromptSpan, first: int, last: int) -> tuple[int, int]:
    """The hidden rows [start, end) of one pass."""
    return span.row + first - span.start, span.row + last - span.start


@torch.inference_mode()
def record_prompt_logprobs(compute_logits, hidden: torch.Tensor, spans: list[PromptSpan]) -> None:
    """Fill each span's entries in req.prompt_logprobs. compute_logits: hidden rows -> logits."""
    for span, first, last in span_passes(spans):
        req, k = span.req, span.req.sampling_params.prompt_logprobs
        if req.prompt_logprobs is None or len(req.prompt_logprobs) != req.num_prompt_tokens:
            req.prompt_logprobs = [None] * req.num_prompt_tokens
        start, end = pass_rows(span, first, last)
        rows = hidden[start:end]
        logp = compute_logits(rows).float().log_softmax(dim=-1)
        targets = torch.tensor(req.prompt_token_ids[first + 1:last + 1], device=logp.device)
        chosen = logp.gather(1, targets[:, None])
        ranks = (logp > chosen).sum(dim=-1) + 1
        top_values, top_ids = logp.topk(k, dim=-1) if k else (None, None)
        _store(req, first, targets.tolist(), chosen[:, 0].tolist(), ranks.tolist(),
               top_ids.tolist() if k else None, top_values.tolist() if k else None)


def _store(req: Request, first: int, targets: list[int], values: list[float], ranks: list[int],
           top_ids: list[list[int]] | None, top_values: list[list[float]] | None) -> None:
    for j, (token, value, rank) in enumerate(zip(targets, values, ranks)):
        top = list(zip(top_ids[j], top_values[j])) if top_ids is not None else []
        req.prompt_logprobs[first + 1 + j] = TokenLogprob(token, value, top, rank)


def take_prompt_logprobs(req: Request) -> list[TokenLogprob | None] | None:
    """The request's prompt logprobs, with its first token (called as that token is settled,
    before or after it joins the output): None for every later token."""
    if req.sampling_params.prompt_logprobs is None or req.num_output_tokens > 1:
        return None
    found = req.prompt_logprobs or [None] * req.num_prompt_tokens
    missing = [i for i, e in enumerate(found) if e is None and i > 0]
    if missing:  # never reported silently short: the engine computes every position
        raise RuntimeError(f"prompt logprobs missing at positions {missing[:8]}")
    req.prompt_logprobs = None
    return found
