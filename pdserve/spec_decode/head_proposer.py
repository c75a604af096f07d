"""Drafting with a head on the target's hidden states (EAGLE, DeepSeek MTP): the part both share.

The head is one decoder layer with its own paged KV. Its row r stands at target position
offset + r: its input is the token at position offset + r + 1 and the target's hidden state at
position offset + r (the layer's output there predicts the token after that one). So a shadow
request per target request holds tokens[offset + 1:], and its KV covers the rows whose target
hidden states it has consumed. Drafting a request whose last token sits at position N - 1 first
catches the head up over rows up to target position N - 2 (the target's hidden states of what it
committed since), whose last output gives draft 1; then each further draft is one row fed the
previous draft and the head's own output hidden state. The draft rows are dropped afterwards:
the next step recomputes the accepted ones from the target's hidden states (as vLLM does).

The head attends only over rows whose target hidden states this node computed: a request whose
prompt KV came from a prefill node (or the prefix cache) starts its shadow at the first position
computed here (offset > 0). Verification keeps the output exact either way; only acceptance
drops while the head's context is short (docs/speculative-decoding.md).
"""
from __future__ import annotations

import torch

from pdserve.engine.request import Request
from pdserve.engine.speculation import SpeculationHost
from pdserve.kvstore.layout import KVLayout
from pdserve.protocol.block_keys import kv_entry_dims
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.spec_decode.eligible import may_speculate
from pdserve.spec_decode.hidden_stash import HiddenStash
from pdserve.spec_decode.own_kv import own_paged_runner

HEAD_SALT = b"pdserve-spec-head"  # the head's pool caches nothing; its keys are never shared


class HeadProposer:
    """head: forward(token_ids, positions, ctx) reading head.hidden_in [T, hidden]; logits(out)."""

    def __init__(self, head, head_config, host: SpeculationHost, pre_norm: bool):
        self.head, self.host = head, host
        planes, heads, dim = kv_entry_dims(head_config)
        layout = KVLayout(1, heads, dim, host.config.block_size, host.dtype, "spec-head", planes)
        self.kv, self.runner = own_paged_runner(head, layout, host, HEAD_SALT)
        self.stash = HiddenStash(may_speculate)
        self.shadows: dict[str, Request] = {}
        self.offsets: dict[str, int] = {}  # target position of each shadow's row 0
        self._pre_norm: list[torch.Tensor] = []
        if pre_norm:  # MTP reads the hidden states before the target's final norm
            host.model.norm.register_forward_pre_hook(lambda _mod, args: self._pre_norm.append(args[0]))
        host.runner.set_hidden_sink(self._on_target_step)

    def _on_target_step(self, items: list[tuple[Request, int]], hidden: torch.Tensor) -> None:
        if self._pre_norm:
            hidden = self._pre_norm.pop()
            self._pre_norm.clear()
        self.stash.record(items, hidden)

    @torch.inference_mode()
    def propose_batch(self, wanted: list[tuple[Request, int]]) -> list[list[int]]:
        self._drop_finished()
        items, hidden, ks = [], [], {}
        for req, k in wanted:
            got = self._catch_up(req)
            if got is None:
                continue
            shadow, rows = got
            if self.kv.allocate(shadow, len(rows) + k):
                items.append((shadow, len(rows)))
                hidden.append(rows)
                ks[req.request_id] = k
        committed = {shadow.request_id: shadow.num_tokens for shadow, _ in items}
        drafts: dict[str, list[int]] = {rid: [] for rid in ks}
        while items:
            items, hidden = self._draft_step(items, hidden, drafts, ks)
        for rid, n in committed.items():  # forget the draft rows: the target decides what stays
            shadow = self.shadows[rid]
            shadow.num_computed_tokens = n
            del shadow.all_token_ids[n:]
        return [drafts.get(req.request_id, []) for req, _ in wanted]

    def _draft_step(self, items, hidden, drafts, ks):
        """One head pass over the items' new rows: one draft each, and the next pass's inputs."""
        order = sorted(range(len(items)), key=lambda i: items[i][1] != 1)  # as the runner orders them
        items, hidden = [items[i] for i in order], [hidden[i] for i in order]
        self.head.hidden_in = torch.cat(hidden)
        outs = self.runner.hidden_states(items)
        last = torch.stack([out[-1] for out in outs])
        tokens = self.head.logits(last).argmax(dim=-1).tolist()
        next_items, next_hidden = [], []
        for (shadow, n), out, token in zip(items, last, tokens):
            shadow.num_computed_tokens += n
            rid = shadow.request_id
            drafts[rid].append(token)
            if len(drafts[rid]) < ks[rid]:
                shadow.all_token_ids.append(token)
                next_items.append((shadow, 1))
                next_hidden.append(out[None])
        return next_items, next_hidden

    def _catch_up(self, req: Request) -> tuple[Request, torch.Tensor] | None:
        """The request's shadow, its tokens the target's up to the last, and the target hidden
        states of its rows not yet computed (None: the stash lacks them; no draft this step)."""
        rid, end = req.request_id, req.num_tokens - 1  # rows up to target position N - 2
        got = self.stash.take(rid, end)
        if got is None:
            return None
        start, rows = got
        shadow, offset = self.shadows.get(rid), self.offsets.get(rid, 0)
        if shadow is None or not offset <= start <= offset + shadow.num_computed_tokens:
            self.release(rid)  # a gap (or positions before the shadow): start over at start
            shadow = self.shadows[rid] = Request(rid, [], SamplingParams())
            offset = self.offsets[rid] = start
        else:
            keep = offset + shadow.num_computed_tokens
            rows = rows[keep - start:] if keep <= end else rows[:0]
            start = keep
        shadow.num_computed_tokens = start - offset
        shadow.all_token_ids = list(req.all_token_ids[offset + 1:])
        if len(rows) == 0:
            return None
        return shadow, rows

    def _drop_finished(self) -> None:
        for rid in [rid for rid in self.shadows if self.host.get_request(rid) is None]:
            self.release(rid)
        for rid in [rid for rid in self.stash.rows if self.host.get_request(rid) is None]:
            self.stash.drop(rid)

    def release(self, request_id: str) -> None:
        shadow = self.shadows.pop(request_id, None)
        self.offsets.pop(request_id, None)
        self.stash.drop(request_id)
        if shadow is not None:
            self.kv.free(shadow)
