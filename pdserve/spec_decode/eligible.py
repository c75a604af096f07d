"""Which requests speculation may draft for (the speculator and the heads' hidden-state stash
both ask)."""
from __future__ import annotations

from pdserve.engine.request import Request


def may_speculate(req: Request) -> bool:
    """Requests whose every output feature verification reproduces exactly. Logits edits that
    depend on the tokens before each position (penalties, bad words, min_tokens; logit_bias
    goes with them), grammars, prompt logprobs and KV handovers decode one token a step."""
    p = req.sampling_params
    return (not p.has_logits_processors and req.matcher is None and p.prompt_logprobs is None
            and not req.hold_blocks)
