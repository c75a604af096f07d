"""The driver's model runner at TP > 1: each step's inputs go to the workers, then rank 0 runs
its own shard through the same code the workers run (shard_step), and samples from the
gathered logits as at TP 1. No CUDA graphs and no async scheduling: both would need the
workers to replay them too."""
from __future__ import annotations

import time

import msgspec
import numpy as np
import torch

from pdserve.engine.model_runner import AttentionContext, ModelRunner
from pdserve.engine.multimodal import ImageRows
from pdserve.engine.prompt_logprobs import prompt_spans
from pdserve.engine.request import Request
from pdserve.engine.state_pool import step_rows
from pdserve.engine.step_inputs import build_step_inputs, is_decode_query
from pdserve.executor.executor import TPExecutor
from pdserve.executor.kv_shared import kv_head_range, rank_layer_caches
from pdserve.executor.shard_step import flatten_inputs, make_plan, multimodal_extras, step_tensors
from pdserve.executor.step_channel import payload_length


class TPModelRunner(ModelRunner):
    def __init__(self, model, executor: TPExecutor, block_size: int, ops, device: torch.device, lora_batch=None,
                 multimodal=None, states=None):
        """states: a hybrid model's pool, over the arena every rank maps (TPExecutor.map_states)."""
        self.executor = executor  # (read by _layer_caches, which ModelRunner's constructor calls)
        super().__init__(model, executor.kv_cache, block_size, ops, device, lora_batch=lora_batch,
                         multimodal=multimodal, states=states)
        self.steps, self.send_seconds = 0, 0.0  # for the benchmark's per-step figures
        self._step_states = None  # the step's StateRows (a hybrid model's), set with its plan

    def _layer_caches(self, kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Rank 0's KV heads of the node's shared cache (the compiled decode step is planned on them)."""
        return rank_layer_caches(kv_cache, kv_head_range(kv_cache.shape[4], self.executor.tp_size, 0))

    @torch.inference_mode()
    def execute(self, items: list[tuple[Request, int]], all_logits: bool = False, pending=None
                ) -> tuple[torch.Tensor, list[Request]]:
        if pending is not None:
            raise RuntimeError("async scheduling is off at tensor_parallel_size > 1")
        items = self._ordered(items)  # decode-shaped queries (drafts too) first; LoRA runs grouped
        inputs, spans, plan = self._step_plan(items, all_logits)
        hidden = self._run_step(plan, inputs, items=items)
        if self._hidden_sink is not None:  # a drafting head (EAGLE, MTP) reads rank 0's hidden states
            self._hidden_sink(items, hidden)
        return self._step_logits(hidden, inputs, spans, all_logits)

    def _step_plan(self, items: list[tuple[Request, int]], all_logits: bool):
        """(step inputs, prompt-logprob spans, the workers' plan) of ordered items. The plan counts
        decode rows, not requests: a drafted query is one decode row per token."""
        num_decodes = sum(1 for r, n in items if is_decode_query(r, n))
        spans = prompt_spans(items)
        inputs = build_step_inputs(items, num_decodes, self.block_size)
        plan = make_plan(inputs, inputs.num_decode_tokens, spans, all_logits, in_shm=False)
        return inputs, spans, self._with_states(plan, items, inputs.num_decode_tokens)

    def _with_states(self, plan, items, num_decodes: int):
        """A hybrid model's step: its rows' state slots in the plan (step_rows zeroes the fresh
        ones in the shared arena, before the workers step)."""
        self._step_states = None
        if self.states is None:
            return plan
        rows = self._step_states = step_rows(self.states, items, num_decodes, self.device)
        return msgspec.structs.replace(plan, state_slots=rows.slots.tolist(), state_spans=list(rows.spans))

    def _forward_hidden(self, inputs, num_decodes: int, items=()) -> torch.Tensor:
        """Hidden states only (embeddings): the workers run the same forward pass, with no LM
        head passes, so every collective has all its ranks."""
        plan = self._with_states(make_plan(inputs, num_decodes, [], False, in_shm=False), items, num_decodes)
        return self._run_step(msgspec.structs.replace(plan, sample_rows=[]), inputs, items=items)

    def _run_step(self, plan, inputs, offset: int = 0, items=(), end: int | None = None) -> torch.Tensor:
        """Send a step to the workers, then run rank 0's shard of its forward pass. offset, end:
        where its arrays may go in the shared buffer (pipeline steps in flight each have a
        region of their own; arrays that do not fit are broadcast);
        items: the step's (request, tokens) in row order, which a vision-language model's images
        and positions come from."""
        flat = flatten_inputs(inputs)
        images = None
        if self.multimodal is not None:
            plan, flat, images = self._with_images(plan, flat, inputs, items)
        flat = torch.from_numpy(flat)
        if self.lora_batch is not None:  # the workers apply the same adapters to the same rows
            plan = msgspec.structs.replace(plan, lora_rows=self.lora_batch.step_rows)
        length = payload_length(plan)
        if self.executor.channel.fits(offset + length) and (end is None or offset + length <= end):
            plan = msgspec.structs.replace(plan, in_shm=True, payload_offset=offset)
        started = time.perf_counter()
        self.executor.send(plan, flat)
        if images is not None:
            self.executor.channel.broadcast_embeddings(images.values)
        self.send_seconds += time.perf_counter() - started
        self.steps += 1
        token_ids, positions, meta = step_tensors(flat, plan, self.device)
        ctx = AttentionContext(self.ops, self.layer_caches, meta, self._step_states)
        return self.model(token_ids, positions, ctx) if images is None else self.model(token_ids, positions, ctx,
                                                                                        images=images)

    def _with_images(self, plan, flat, inputs, items):
        """A vision-language model's step: its [3, T] positions and image rows appended to the
        arrays (every rank builds the same embedding input)."""
        mm = self.multimodal
        positions = mm.positions(items, inputs.ints64[1]) if getattr(self.model, "uses_mrope", True) else None
        images = mm.image_rows(items, self.device)
        if images is not None:  # float32 on the wire: exact for any model dtype (merge casts)
            images = ImageRows(images.rows, images.values.to(torch.float32).contiguous())
        plan = msgspec.structs.replace(plan, mrope_positions=positions is not None,
                                       image_rows=0 if images is None else int(images.rows.shape[0]))
        return plan, np.concatenate([flat, multimodal_extras(positions, images)]), images
