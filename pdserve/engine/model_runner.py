"""Turns a scheduled batch into model inputs, runs the model over the paged KV cache, and
returns logits for the requests that reached the end of their tokens this step."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve.engine.image_attention import image_key_ends
from pdserve.engine.multimodal import MultiModalInputs
from pdserve.engine.overlap import pending_sources, take_pending
from pdserve.engine.prompt_logprobs import prompt_spans, record_prompt_logprobs
from pdserve.engine.request import Request
from pdserve.engine.state_pool import StatePool, StateRows, step_rows
from pdserve.engine.step_inputs import KeptTableRows, build_step_inputs, fill_decode_rows, is_decode_query
from pdserve.kernels import get_fused_layer_ops, native_decode

HiddenSink = Callable[[list[tuple[Request, int]], torch.Tensor], None]
# Given a step's items before its forward pass: a callable told each layer's index as that layer's
# KV lands in the cache (push mode's layer-wise WRITEs), or None for a step it need not hear of.
LayerListener = Callable[[list[tuple[Request, int]]], Callable[[int], None] | None]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor          # [T] int64
    num_decodes: int                    # the first num_decodes tokens are one-token queries
    decode_block_tables: torch.Tensor   # [D, max_blocks] int32
    decode_context_lens: torch.Tensor   # [D] int32
    prefill_cu_seqlens: torch.Tensor    # [P+1] int32, relative to the first prefill token
    prefill_context_lens: torch.Tensor  # [P] int32
    prefill_block_tables: torch.Tensor  # [P, max_blocks] int32
    # [prefill tokens] int64 or None: each prefill query sees keys below this position rather
    # than up to its own (a bidirectional image token sees its whole image; see image_attention)
    prefill_key_ends: torch.Tensor | None = None


class AttentionContext:
    """Handed to the model for one forward pass: each layer's attention goes through here."""

    def __init__(self, ops, layer_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                 states: StateRows | None = None, on_stored: Callable[[int], None] | None = None):
        self.ops, self.layer_caches, self.meta = ops, layer_caches, meta
        self.states = states  # a hybrid model's state slots for this step's rows (engine.state_pool)
        self.on_stored = on_stored  # told each layer once its KV is in the cache (see LayerListener)

    def layer_stored(self, layer: int) -> None:
        """Layer `layer`'s KV for this step is in the cache (a model that stores its own, as MLA
        does, says so here too)."""
        if self.on_stored is not None:
            self.on_stored(layer)

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """window > 0: the layer's sliding window in tokens; sinks [heads]: its attention sinks
        (see pdserve.models.attention). Every backend's kernels take both."""
        k_cache, v_cache = self.layer_caches[layer]
        m = self.meta
        self.ops.store_kv(k, v, k_cache, v_cache, m.slot_mapping)
        self.layer_stored(layer)
        extra = {}
        if window:
            extra["window"] = window
        if sinks is not None:
            extra["sinks"] = sinks
        d = m.num_decodes
        if d == q.shape[0]:
            return self.ops.paged_decode_attention(q, k_cache, v_cache, m.decode_block_tables,
                                                   m.decode_context_lens, scale, **extra)
        if m.prefill_key_ends is not None:  # only a backend with PREFILL_KEY_ENDS gets here (assembly)
            extra["key_ends"] = m.prefill_key_ends
        prefill = self.ops.prefill_attention(q[d:], k[d:], v[d:], k_cache, v_cache, m.prefill_cu_seqlens,
                                             m.prefill_context_lens, m.prefill_block_tables, scale, **extra)
        extra.pop("key_ends", None)  # decode rows are text: causal
        if d == 0:
            return prefill
        decode = self.ops.paged_decode_attention(q[:d], k_cache, v_cache, m.decode_block_tables,
                                                 m.decode_context_lens, scale, **extra)
        return torch.cat([decode, prefill])



class ModelRunner:
    """Runs scheduled batches. On CUDA, with a kernel module that allows it and unless
    use_cuda_graphs is off (the engine's enforce_eager), pure-decode batches of up to
    max_num_seqs requests replay captured CUDA graphs; everything else runs eagerly."""

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int, ops, device: torch.device,
                 max_num_seqs: int = 0, max_model_len: int = 0, use_cuda_graphs: bool = False, lora_batch=None,
                 multimodal: MultiModalInputs | None = None, states: StatePool | None = None):
        self.states = states  # a hybrid model's recurrent-state pool; None for attention-only models
        self.model, self.kv_cache, self.block_size, self.ops, self.device = model, kv_cache, block_size, ops, device
        self.multimodal = multimodal  # a vision-language model's images and [3, T] positions
        self.lora_batch = lora_batch  # pdserve.lora.slots.LoRABatch: set to each step's adapter runs
        self._hidden_sink: HiddenSink | None = None  # see set_hidden_sink
        self.layer_listener: LayerListener | None = None  # push mode's layer-wise WRITEs (node.push_writes)
        self.layer_caches = self._layer_caches(kv_cache)
        model.fused = get_fused_layer_ops(ops, device.type)
        # One compiled call for a decode step's layers, for a model that declares it can take it.
        if hasattr(model, "native_decode_weights"):
            model.native_decode = native_decode.plan_for(model, self.layer_caches, device, lora_batch)
        self.graphs: DecodeGraphs | None = None
        self.kept_rows: KeptTableRows | None = None
        if (use_cuda_graphs and device.type == "cuda" and getattr(ops, "CUDA_GRAPH_SAFE", False)
                and getattr(model, "cuda_graph_safe", True)
                and max_num_seqs > 0 and max_model_len > 0):
            max_blocks = -(-max_model_len // block_size)
            self.graphs = DecodeGraphs(model, self._decode_context, device, max_num_seqs, max_blocks)
            self.graphs.capture()
            self.kept_rows = KeptTableRows(2 * max_num_seqs, max_blocks)

    def _layer_caches(self, kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Per layer, one view per plane: (K, V), or (latent,) for an MLA cache."""
        return [tuple(kv_cache[:, i].unbind(1)) for i in range(kv_cache.shape[1])]

    def set_hidden_sink(self, sink: HiddenSink | None) -> None:
        """sink(items, hidden) gets each eager step's items and final hidden states [T, hidden]
        in their rows' order: a drafting head (EAGLE, MTP) drafts from them. None: no cost."""
        self._hidden_sink = sink

    def _decode_context(self, slots, tables, context_lens) -> AttentionContext:
        empty = torch.zeros(0, dtype=torch.int32, device=self.device)
        meta = AttentionMetadata(slot_mapping=slots, num_decodes=slots.shape[0],
                                 decode_block_tables=tables, decode_context_lens=context_lens,
                                 prefill_cu_seqlens=empty, prefill_context_lens=empty,
                                 prefill_block_tables=empty.view(0, 1))
        return AttentionContext(self.ops, self.layer_caches, meta)

    @torch.inference_mode()
    def execute(self, items: list[tuple[Request, int]], all_logits: bool = False, pending=None
                ) -> tuple[torch.Tensor, list[Request]]:
        """Runs one step; returns logits [S, vocab] for the S requests to sample, in order
        (or for every token when all_logits). pending: (device tokens, request id -> row) of
        the step before, for one-token queries whose token is still PENDING_TOKEN on the host."""
        items = self._ordered(items)
        num_decodes = sum(1 for r, n in items if is_decode_query(r, n))
        spans = prompt_spans(items)  # rows whose logits give prompt logprobs
        if (not all_logits and not spans and all(n == 1 for _, n in items)
                and self._graph_fits(items)):
            return self._execute_graph([r for r, _ in items], pending)
        inputs = build_step_inputs(items, num_decodes, self.block_size)
        token_ids, positions, meta = self._to_device(inputs, inputs.num_decode_tokens)
        if pending is not None:
            sources = pending_sources([r for r, _ in items[:num_decodes]], pending[1])
            token_ids[:num_decodes] = take_pending(token_ids[:num_decodes], pending[0],
                                                   torch.from_numpy(sources).to(self.device))
        hidden = self._run_model(items, inputs, token_ids, positions, meta)
        if self._hidden_sink is not None:
            self._hidden_sink(items, hidden)
        return self._step_logits(hidden, inputs, spans, all_logits)

    def _run_model(self, items, inputs, token_ids, positions, meta) -> torch.Tensor:
        """The model over a step's rows (items in row order); a multimodal model also gets the
        step's image embeddings, and its [3, T] positions (M-RoPE) or its image tokens' key ends
        (bidirectional images)."""
        mm = self.multimodal
        states = None if self.states is None else step_rows(self.states, items, meta.num_decodes, self.device)
        stored = self.layer_listener(items) if self.layer_listener is not None else None
        if mm is None:
            return self.model(token_ids, positions, AttentionContext(self.ops, self.layer_caches, meta, states, stored))
        if getattr(self.model, "uses_mrope", True):
            positions = torch.from_numpy(mm.positions(items, inputs.ints64[1])).to(self.device)
        if getattr(self.model, "bidirectional_images", False):
            ends = image_key_ends(items, inputs.ints64[1], meta.num_decodes)
            meta.prefill_key_ends = torch.from_numpy(ends).to(self.device) if ends is not None else None
        ctx = AttentionContext(self.ops, self.layer_caches, meta, states, stored)  # states: a hybrid's (Qwen3.5)
        return self.model(token_ids, positions, ctx, images=mm.image_rows(items, self.device))

    def _ordered(self, items: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        """Decode-shaped queries (one token, or one plus drafts) first. With LoRA adapters, each
        kind's requests grouped by adapter slot, so the step's LoRA products run once per adapter
        (pdserve.lora.slots)."""
        if self.lora_batch is None:
            return sorted(items, key=lambda it: not is_decode_query(*it))
        items = sorted(items, key=lambda it: (not is_decode_query(*it),
                                              -1 if it[0].lora_slot is None else it[0].lora_slot))
        self.lora_batch.set_runs([(r.lora_slot, n) for r, n in items])
        return items

    def _step_logits(self, hidden: torch.Tensor, inputs, spans, all_logits: bool
                     ) -> tuple[torch.Tensor, list[Request]]:
        """A step's logits from its hidden states: prompt logprobs recorded, then every token's
        (all_logits) or the sampled rows'."""
        if spans:
            record_prompt_logprobs(self.model.compute_logits, hidden, spans)
        if all_logits:
            return self.model.compute_logits(hidden), inputs.to_sample
        if not inputs.to_sample:
            return torch.empty(0), []
        return self.model.compute_logits(hidden[inputs.sample_rows]), inputs.to_sample

    def _forward_hidden(self, inputs, num_decodes: int, items=()) -> torch.Tensor:
        """The final hidden states of a step's tokens (items: in row order), with no logits
        (TPModelRunner also has its workers run the step)."""
        token_ids, positions, meta = self._to_device(inputs, num_decodes)
        return self._run_model(items, inputs, token_ids, positions, meta)

    @torch.inference_mode()
    def hidden_states(self, items: list[tuple[Request, int]]) -> list[torch.Tensor]:
        """The model's final hidden states (its last norm applied, before lm_head) at each
        item's new tokens, one [n, hidden] tensor per item in the order given. Eager: no graphs,
        no logits (embeddings pool these)."""
        order = sorted(range(len(items)), key=lambda i: items[i][1] != 1)  # as execute: one-token queries first
        ranked = [items[i] for i in order]
        if self.lora_batch is not None:
            self.lora_batch.set_runs([(r.lora_slot, n) for r, n in ranked])
        num_decodes = sum(1 for _, n in ranked if n == 1)
        inputs = build_step_inputs(ranked, num_decodes, self.block_size)
        hidden = self._forward_hidden(inputs, inputs.num_decode_tokens, ranked)
        pieces = hidden.split([n for _, n in ranked])
        out: list[torch.Tensor] = [hidden] * len(items)
        for piece, i in zip(pieces, order):
            out[i] = piece
        return out

    def _graph_fits(self, items: list[tuple[Request, int]]) -> bool:
        g = self.graphs
        return (g is not None and 0 < len(items) <= g.max_batch
                and max(len(r.block_ids) for r, _ in items) <= g.max_blocks)

    def _execute_graph(self, reqs: list[Request], pending=None) -> tuple[torch.Tensor, list[Request]]:
        ints64, context_lens, tables = self.graphs.host_views()
        fill_decode_rows(reqs, self.block_size, ints64, context_lens, tables, self.kept_rows)
        sources = None
        if pending is not None:
            sources = self.graphs.host_sources(len(reqs))
            sources[:] = pending_sources(reqs, pending[1])
        logits = self.graphs.replay(len(reqs), pending[0] if pending is not None else None, sources)
        # A one-token query that does not end its request (a prefill's last chunk of one token
        # short of the end) has nothing to sample.
        rows = [i for i, r in enumerate(reqs) if r.num_computed_tokens + 1 == r.num_tokens]
        if len(rows) == len(reqs):
            return logits, reqs
        return logits[rows], [reqs[i] for i in rows]

    def _to_device(self, inputs, num_decodes: int):
        """Two host-to-device copies: every int64 input, then every int32 input."""
        ints64 = torch.from_numpy(inputs.ints64).to(self.device)
        ints32 = torch.from_numpy(inputs.ints32()).to(self.device)
        shapes = inputs.int32_shapes()
        parts = ints32.split([int(np.prod(s)) for s in shapes])
        ctx, table, cu, pctx, ptable = (part.view(shape) for part, shape in zip(parts, shapes))
        meta = AttentionMetadata(slot_mapping=ints64[2], num_decodes=num_decodes,
                                 decode_block_tables=table, decode_context_lens=ctx,
                                 prefill_cu_seqlens=cu, prefill_context_lens=pctx,
                                 prefill_block_tables=ptable)
        return ints64[0], ints64[1], meta
