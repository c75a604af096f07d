"""One model step on one rank, the same on the driver and on every worker: the step's flat
inputs into tensors, the forward pass over the rank's shard and KV heads (and, with pipeline
stages, its layers: the hidden states come from the stage before and go to the stage after),
and the LM-head passes (each a collective, so every rank runs them in the same order)."""
from __future__ import annotations

import numpy as np
import torch

from pdserve.engine.model_runner import AttentionContext, AttentionMetadata
from pdserve.engine.multimodal import ImageRows
from pdserve.engine.prompt_logprobs import pass_rows, span_passes
from pdserve.engine.step_inputs import StepInputs
from pdserve.executor.messages import StepPlan
from pdserve.executor.stage_link import StageLink


def make_plan(inputs: StepInputs, num_decodes: int, spans, all_logits: bool, in_shm: bool) -> StepPlan:
    passes = [pass_rows(span, first, last) for span, first, last in span_passes(spans)]
    return StepPlan(num_tokens=int(inputs.ints64.shape[1]), num_decodes=num_decodes,
                    int32_shapes=[list(s) for s in inputs.int32_shapes()], logit_passes=passes,
                    sample_rows=list(inputs.sample_rows), all_logits=all_logits, in_shm=in_shm)


def flatten_inputs(inputs: StepInputs) -> np.ndarray:
    return np.concatenate([inputs.ints64.ravel(), inputs.ints32().astype(np.int64)])


def step_tensors(flat: torch.Tensor, plan: StepPlan, device: torch.device):
    """(token ids, positions, AttentionMetadata) from the flat int64 inputs; positions are
    [3, T] for a multimodal-RoPE model's step."""
    flat = flat.to(device)
    t = plan.num_tokens
    ints64 = flat[: 3 * t].view(3, t)
    sizes = [int(np.prod(s)) for s in plan.int32_shapes]
    end = 3 * t + sum(sizes)
    parts = flat[3 * t:end].to(torch.int32).split(sizes)
    ctx, table, cu, pctx, ptable = (p.view(*s) for p, s in zip(parts, plan.int32_shapes))
    meta = AttentionMetadata(slot_mapping=ints64[2], num_decodes=plan.num_decodes,
                             decode_block_tables=table, decode_context_lens=ctx,
                             prefill_cu_seqlens=cu, prefill_context_lens=pctx,
                             prefill_block_tables=ptable)
    positions = flat[end:end + 3 * t].view(3, t) if plan.mrope_positions else ints64[1]
    return ints64[0], positions, meta


def multimodal_extras(positions: np.ndarray | None, images: ImageRows | None) -> np.ndarray:
    """What a vision-language model's step adds to the flat arrays: its [3, T] positions, then
    the rows its image embeddings go to (the embeddings travel beside, as floats)."""
    parts = [positions.ravel()] if positions is not None else []
    if images is not None:
        parts.append(images.rows.cpu().numpy())
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


def step_images(flat: torch.Tensor, plan: StepPlan, values: torch.Tensor | None) -> ImageRows | None:
    """The step's image rows (the flat arrays' tail) with their embeddings."""
    if not plan.image_rows or values is None:
        return None
    return ImageRows(flat[flat.shape[0] - plan.image_rows:].to(values.device), values)


def result_rows(plan: StepPlan) -> int:
    """Rows of logits a step gives the driver: the prompt-logprob passes', then the sampled rows'
    (or every row's)."""
    sampled = plan.num_tokens if plan.all_logits else len(plan.sample_rows)
    return sum(end - start for start, end in plan.logit_passes) + sampled


def step_logits(model, hidden: torch.Tensor, plan: StepPlan) -> torch.Tensor:
    """The step's logit rows in the plan's order (result_rows of them), each pass a collective."""
    parts = [model.compute_logits(hidden[start:end]) for start, end in plan.logit_passes]
    if plan.all_logits:
        parts.append(model.compute_logits(hidden))
    elif plan.sample_rows:
        parts.append(model.compute_logits(hidden[plan.sample_rows]))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.float32)


@torch.inference_mode()
def run_worker_step(model, ops, layer_caches, device: torch.device, plan: StepPlan, flat: torch.Tensor,
                    link: StageLink | None = None, images: ImageRows | None = None, states=None) -> None:
    """A worker's share of a step. Without pipeline stages (link None) the logits it helps
    gather are the driver's to use; with them, a stage before the last hands its hidden states
    on, and the last stage's first rank sends the step's results to the driver. images: a
    vision-language model's embeddings for the step's placeholder rows (TP only). states: a
    hybrid model's StateRows (engine.state_pool) over the shared arena (TP only)."""
    token_ids, positions, meta = step_tensors(flat, plan, device)
    if link is not None and not link.role.first:
        model.embed_tokens.hidden = link.recv_hidden(plan.num_tokens)
    ctx = AttentionContext(ops, layer_caches, meta, states)
    hidden = model(token_ids, positions, ctx) if images is None else model(token_ids, positions, ctx, images=images)
    if link is not None and not link.role.last:
        link.send_hidden(hidden)
        return
    result = hidden if plan.return_hidden else step_logits(model, hidden, plan)
    if link is not None and link.role.tp_rank == 0:
        link.send_result(result)
