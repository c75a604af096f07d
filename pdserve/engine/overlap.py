"""Overlapped decode steps, in the manner of vLLM v1's async scheduling and SGLang's overlap
scheduler: step N+1 is scheduled and launched before step N's sampled tokens reach the host, so
the host's scheduling, input building, detokenization and stop checks run while the GPU
computes instead of between its kernels.

A request whose newest token is still on the device carries PENDING_TOKEN in its token lists.
The next launch reads that token from the previous step's device tensor (ModelRunner's
`pending`), and the host fills it in once that next step is on its way. A request found to have
stopped (EOS, a stop id, a stop string) was computed one token too far: the extra token is
dropped and its blocks are freed at once. That is safe because later launches run after this
one on the same stream. A request whose pending token is its last by length (max_tokens, the
model's length) is not scheduled again, so length stops cost nothing extra.

Only plain greedy decode batches overlap. A step that needs the newest tokens on the host
(penalties, grammars, logprobs, random draws) or that holds a prefill collects the step in
flight first and then runs synchronously, exactly as without overlap.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.request import PENDING_TOKEN, Request
from pdserve.engine.sampler import greedy_tokens
from pdserve.protocol.outputs import StepOutput


@dataclass
class InFlightStep:
    """A launched step whose sampled tokens are on their way to the host."""
    reqs: list[Request]           # the requests sampled, row by row
    rows: dict[str, int]          # request id -> row in tokens_device
    tokens_device: torch.Tensor   # [n] int64, read by the next launch
    tokens_host: torch.Tensor     # [n] int64, pinned on CUDA, filled asynchronously
    copied: torch.cuda.Event | None


def overlappable(items: list[tuple[Request, int]]) -> bool:
    """A pure decode batch whose tokens the device alone can choose (greedy, nothing else)."""
    return bool(items) and all(n == 1 and _plain_greedy(r) for r, n in items)


def _plain_greedy(req: Request) -> bool:
    p = req.sampling_params
    return (p.greedy and p.logprobs is None and p.structured is None and not p.has_logits_processors
            and req.output_token_ids != [])


def launch(engine, items: list[tuple[Request, int]], prev: InFlightStep | None) -> InFlightStep:
    """Runs a step without waiting for it: greedy tokens are chosen on the device and copied
    to the host asynchronously."""
    pending = (prev.tokens_device, prev.rows) if prev is not None else None
    logits, to_sample = engine.runner.execute(items, pending=pending)
    tokens = greedy_tokens(logits)
    on_cuda = tokens.device.type == "cuda"
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=on_cuda)
    host.copy_(tokens, non_blocking=on_cuda)
    copied = None
    if on_cuda:
        copied = torch.cuda.Event()
        copied.record()
    for req, n in items:
        req.num_computed_tokens += n
    return InFlightStep(list(to_sample), {r.request_id: i for i, r in enumerate(to_sample)},
                        tokens, host, copied)


def collect(engine, step: InFlightStep) -> list[StepOutput]:
    """Fills in the step's tokens and settles each request (stops, text), as a synchronous
    step would have right after sampling."""
    if step.copied is not None:
        step.copied.synchronize()
    tokens = step.tokens_host.tolist()
    outputs = []
    for req in step.reqs:
        if req.status.is_finished:  # aborted while its token was in flight
            continue
        token = tokens[step.rows[req.request_id]]
        req.output_token_ids[-1] = token
        req.all_token_ids[-1] = token
        req.awaiting_last_token = False
        outputs.append(engine.settle(req, token, None))
    return outputs


def after_launch(engine, items: list[tuple[Request, int]], step: InFlightStep) -> InFlightStep:
    """Once the step before has been collected (every computed token is known): commit the
    launched step's full blocks, and give each live request its pending token."""
    for req, _ in items:
        if not req.status.is_finished:
            engine.kv.commit(req)
    live = [r for r in step.reqs if not r.status.is_finished]
    for req in live:
        req.append_output(PENDING_TOKEN)
        p = req.sampling_params
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= engine.max_model_len:
            req.awaiting_last_token = True  # its pending token ends it: nothing more to compute
    if len(live) != len(step.reqs):  # rows keep their places: the next launch indexes by id
        step.rows = {r.request_id: step.rows[r.request_id] for r in live}
        step.reqs = live
    return step


def overlapped_step(engine) -> list[StepOutput]:
    """One engine step with overlap (see the module docstring)."""
    batch = engine.scheduler.schedule()
    engine.last_step_tokens = batch.num_tokens
    prev, engine.in_flight = engine.in_flight, None
    if not overlappable(batch.items):
        outputs = collect(engine, prev) if prev is not None else []
        batch.items = [(r, n) for r, n in batch.items if not r.status.is_finished]
        return outputs + engine.run_batch(batch)
    step = launch(engine, batch.items, prev)
    outputs = collect(engine, prev) if prev is not None else []
    engine.in_flight = after_launch(engine, batch.items, step)
    return outputs


def pending_sources(reqs: list[Request], rows: dict[str, int]) -> np.ndarray:
    """Per one-token query: the row of the step before's tokens that holds its input token, or
    -1 where the host has it."""
    out = np.full(len(reqs), -1, np.int64)
    for i, req in enumerate(reqs):
        if req.all_token_ids[req.num_computed_tokens] == PENDING_TOKEN:
            out[i] = rows[req.request_id]
    return out


def take_pending(token_ids: torch.Tensor, previous: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
    """token_ids with each row whose source is >= 0 replaced by previous[source], on the device."""
    return torch.where(sources >= 0, previous[sources.clamp(min=0)], token_ids)
