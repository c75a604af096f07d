"""Embeddings from a decoder LLM: the final hidden states of a prompt (the model's last norm
applied, before lm_head), pooled over its tokens and L2-normalised, as vLLM's pooling runner
serves /v1/embeddings from the same checkpoint.

A prompt runs through the paged KV cache like any prefill (the attention kernels write K and V
as they go), in blocks borrowed from the free pool for the one forward pass and given back
before it returns: no block stays allocated and none enters the prefix cache.

    pending = EmbeddingBatch(prompts, "last")
    while not pending.done:
        pending.advance(engine)   # False: no room in the KV cache yet, try after a step
    vectors = pending.vectors     # float32, one per prompt
"""
from __future__ import annotations

import numpy as np
import torch

from pdserve.engine.request import Request
from pdserve.protocol.sampling_params import SamplingParams

POOLINGS = ("last", "mean")


def pool(hidden: torch.Tensor, pooling: str) -> np.ndarray:
    """One prompt's vector from its hidden states [n, hidden]: the last token's or the mean,
    L2-normalised, float32."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    h = hidden.float()
    vector = h[-1] if pooling == "last" else h.mean(dim=0)
    vector = vector / vector.norm().clamp_min(1e-12)
    return vector.cpu().numpy()


class EmbeddingBatch:
    """Prompts still to embed, computed a group at a time (a group: as many prompts as fit in
    one step's token budget and in the KV blocks free now)."""

    def __init__(self, prompts: list[list[int]], pooling: str):
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        self.prompts = prompts
        self.pooling = pooling
        self.vectors: list[np.ndarray] = []

    @property
    def done(self) -> bool:
        return len(self.vectors) == len(self.prompts)

    def check(self, engine) -> None:
        """ValueError for a prompt this engine can never embed."""
        vocab, blocks = engine.model.spec.vocab_size, engine.pool.num_blocks * engine.config.block_size
        for ids in self.prompts:
            if not ids:
                raise ValueError("an embedding input is empty")
            if min(ids) < 0 or max(ids) >= vocab:
                raise ValueError(f"token ids must be in [0, {vocab})")
            if len(ids) > min(engine.max_model_len, blocks):
                raise ValueError(f"an embedding input has {len(ids)} tokens; this model accepts at most "
                                 f"{min(engine.max_model_len, blocks)}")

    def advance(self, engine) -> bool:
        """Embed the next group of prompts; False when the KV cache has no room for even one."""
        group = self._next_group(engine.config.max_num_batched_tokens)
        reqs: list[Request] = []
        try:
            for ids in group:
                req = Request(f"__embed_{len(self.vectors) + len(reqs)}", list(ids), SamplingParams(max_tokens=1))
                if not engine.kv.allocate(req, len(ids)):
                    break
                reqs.append(req)
            if not reqs:
                return False
            hidden = engine.runner.hidden_states([(r, r.num_prompt_tokens) for r in reqs])
            self.vectors += [pool(h, self.pooling) for h in hidden]
            return True
        finally:
            for req in reqs:
                engine.kv.free(req)

    def _next_group(self, token_budget: int) -> list[list[int]]:
        group: list[list[int]] = []
        tokens = 0
        for ids in self.prompts[len(self.vectors):]:
            if group and tokens + len(ids) > token_budget:
                break
            group.append(ids)
            tokens += len(ids)
        return group
