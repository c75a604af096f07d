"""A draft model: a small model with the target's vocabulary drafts k tokens greedily.

It keeps its own paged KV cache (as many blocks as the target's, without prefix caching) and a
shadow request per target request, whose KV it extends by what the target accepted since the
last step. So a request that arrives on a decode node with its target KV from a prefill node
first has its draft KV recomputed here over the whole prompt: one draft forward pass of the
prompt, which for a draft ~10x smaller than the target costs ~1/10 of that prefill.
"""
from __future__ import annotations

from pdserve.engine.request import Request
from pdserve.engine.speculation import SpeculationHost
from pdserve.kvstore.layout import KVLayout
from pdserve.models.loader import load_hf_config, load_model, resolve_model_path
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.spec_decode.own_kv import own_paged_runner

DRAFT_SALT = b"pdserve-draft"  # the draft pool caches nothing; its keys are never shared


class DraftModelProposer:
    def __init__(self, config, host: SpeculationHost):
        path = resolve_model_path(config.model)
        hf_config = load_hf_config(path)
        self.model = load_model(path, hf_config, host.dtype, host.device)
        target_vocab, draft_vocab = host.model.spec.vocab_size, self.model.spec.vocab_size
        if draft_vocab != target_vocab:
            raise ValueError(f"speculative config: the draft model {config.model} has a vocabulary of "
                             f"{draft_vocab} tokens, the target's has {target_vocab}; they must be the same")
        layout = KVLayout.for_model(hf_config, host.config.block_size, host.dtype, str(config.model))
        self.kv, self.runner = own_paged_runner(self.model, layout, host, DRAFT_SALT)
        self.host = host
        self.shadows: dict[str, Request] = {}
        self.bases: dict[str, int] = {}  # target tokens a shadow held when it last drafted
        self.catch_up_tokens = 0  # tokens the draft computed beyond one per step: prompts, mostly

    def propose_batch(self, wanted: list[tuple[Request, int]]) -> list[list[int]]:
        self._drop_finished()
        ready: dict[str, int] = {}
        items = []
        for req, k in wanted:
            shadow = self._sync(req)
            n = shadow.num_tokens - shadow.num_computed_tokens
            if self.kv.allocate(shadow, n + k):
                items.append((shadow, n))
                ready[req.request_id] = k
        drafts: dict[str, list[int]] = {rid: [] for rid in ready}
        while items:
            self._draft_step(items, drafts)
            items = [(self.shadows[rid], 1) for rid, d in drafts.items() if len(d) < ready[rid]]
        return [drafts.get(req.request_id, []) for req, _ in wanted]

    def _draft_step(self, items: list[tuple[Request, int]], drafts: dict[str, list[int]]) -> None:
        logits, sampled = self.runner.execute(items)
        for shadow, n in items:
            self.catch_up_tokens += n - 1
            shadow.num_computed_tokens += n
        for shadow, token in zip(sampled, logits.argmax(dim=-1).tolist()):
            shadow.append_output(token)
            drafts[shadow.request_id].append(token)

    def _sync(self, req: Request) -> Request:
        """The request's shadow, its tokens now the target's, its KV kept as far as they agree."""
        rid = req.request_id
        shadow = self.shadows.get(rid)
        if shadow is None:
            shadow = self.shadows[rid] = Request(rid, list(req.all_token_ids), SamplingParams())
        else:
            base, tokens = self.bases[rid], req.all_token_ids
            agree = base
            while agree < min(shadow.num_tokens, len(tokens)) and shadow.all_token_ids[agree] == tokens[agree]:
                agree += 1
            shadow.num_computed_tokens = min(shadow.num_computed_tokens, agree)
            shadow.all_token_ids = list(tokens)
        shadow.output_token_ids = list(req.output_token_ids)
        self.bases[rid] = req.num_tokens
        return shadow

    def _drop_finished(self) -> None:
        for rid in [rid for rid in self.shadows if self.host.get_request(rid) is None]:
            self.release(rid)

    def release(self, request_id: str) -> None:
        shadow = self.shadows.pop(request_id, None)
        self.bases.pop(request_id, None)
        if shadow is not None:
            self.kv.free(shadow)
