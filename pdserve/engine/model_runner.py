"""Turns a scheduled batch into model inputs, runs the model over the paged KV cache, and
returns logits for the requests that reached the end of their tokens this step."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.request import Request
from pdserve.models.llama import LlamaModel


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor          # [T] int64
    num_decodes: int                    # the first num_decodes tokens are one-token queries
    decode_block_tables: torch.Tensor   # [D, max_blocks] int32
    decode_context_lens: torch.Tensor   # [D] int32
    prefill_cu_seqlens: torch.Tensor    # [P+1] int32, relative to the first prefill token
    prefill_context_lens: torch.Tensor  # [P] int32
    prefill_block_tables: torch.Tensor  # [P, max_blocks] int32


class AttentionContext:
    """Handed to the model for one forward pass: each layer's attention goes through here."""

    def __init__(self, ops, layer_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata):
        self.ops, self.layer_caches, self.meta = ops, layer_caches, meta

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        k_cache, v_cache = self.layer_caches[layer]
        m = self.meta
        self.ops.store_kv(k, v, k_cache, v_cache, m.slot_mapping)
        d = m.num_decodes
        if d == q.shape[0]:
            return self.ops.paged_decode_attention(q, k_cache, v_cache, m.decode_block_tables,
                                                   m.decode_context_lens, scale)
        prefill = self.ops.prefill_attention(q[d:], k[d:], v[d:], k_cache, v_cache, m.prefill_cu_seqlens,
                                             m.prefill_context_lens, m.prefill_block_tables, scale)
        if d == 0:
            return prefill
        decode = self.ops.paged_decode_attention(q[:d], k_cache, v_cache, m.decode_block_tables,
                                                 m.decode_context_lens, scale)
        return torch.cat([decode, prefill])


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, block_size: int, ops, device: torch.device):
        self.model, self.kv_cache, self.block_size, self.ops, self.device = model, kv_cache, block_size, ops, device
        self.layer_caches = [(kv_cache[:, i, 0], kv_cache[:, i, 1]) for i in range(kv_cache.shape[1])]

    @torch.inference_mode()
    def execute(self, items: list[tuple[Request, int]], all_logits: bool = False
                ) -> tuple[torch.Tensor, list[Request]]:
        """Runs one step; returns logits [S, vocab] for the S requests to sample, in order
        (or for every token when all_logits)."""
        items = sorted(items, key=lambda it: it[1] != 1)  # one-token queries first
        token_ids, positions, meta, sample_rows, to_sample = self._prepare(items)
        hidden = self.model(token_ids, positions, AttentionContext(self.ops, self.layer_caches, meta))
        if all_logits:
            return self.model.compute_logits(hidden), to_sample
        if not to_sample:
            return torch.empty(0), []
        return self.model.compute_logits(hidden[sample_rows]), to_sample

    def _prepare(self, items: list[tuple[Request, int]]):
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        to_sample: list[Request] = []
        for req, n in items:
            start = req.num_computed_tokens
            tokens.extend(req.all_token_ids[start:start + n])
            positions.extend(range(start, start + n))
            blocks = req.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            if start + n == req.num_tokens:
                sample_rows.append(len(tokens) - 1)
                to_sample.append(req)
        meta = self._metadata(items, slots)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)
        return as_tensor(tokens), as_tensor(positions), meta, sample_rows, to_sample

    def _metadata(self, items: list[tuple[Request, int]], slots: list[int]) -> AttentionMetadata:
        num_decodes = sum(1 for _, n in items if n == 1)
        decodes, prefills = items[:num_decodes], items[num_decodes:]
        cu = [0]
        for _, n in prefills:
            cu.append(cu[-1] + n)
        i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=self.device)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_decodes=num_decodes,
            decode_block_tables=self._block_table([r for r, _ in decodes]),
            decode_context_lens=i32([r.num_computed_tokens + 1 for r, _ in decodes]),
            prefill_cu_seqlens=i32(cu),
            prefill_context_lens=i32([r.num_computed_tokens + n for r, n in prefills]),
            prefill_block_tables=self._block_table([r for r, _ in prefills]),
        )

    def _block_table(self, reqs: list[Request]) -> torch.Tensor:
        width = max((len(r.block_ids) for r in reqs), default=1)
        table = torch.zeros(len(reqs), width, dtype=torch.int32)
        for i, r in enumerate(reqs):
            table[i, :len(r.block_ids)] = torch.tensor(r.block_ids, dtype=torch.int32)
        return table.to(self.device)
