"""Suffix decoding (Arctic Inference's SuffixDecoding, vLLM's method "suffix"): drafts from suffix
trees rather than a model. Each request has its own tree over its prompt and the output so far;
a global tree holds the outputs of recent requests, so a pattern that many requests repeat (an
agent's tool calls, a template's boilerplate) is drafted even when this request has not seen it.
Each step the request's last tokens are matched in both trees, and the draft with the higher
score (the sum of its tokens' estimated probabilities) wins; a longer match may draft more
(vLLM's suffix_decoding_max_spec_factor). No second model, no KV of its own.

Exact like every proposer: drafts are only proposals, the target verifies them. Across P/D the
decode node builds the request's tree from the prompt the handover carries (the request's
tokens), so a handed-over request drafts from its first decode step.

Memory: a request's tree is at most depth nodes per token and goes when the request ends; the
global tree keeps the outputs of at most suffix_decoding_max_cached_requests requests and at
most GLOBAL_MAX_TOKENS tokens, the oldest evicted first.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.request import Request
from pdserve.spec_decode.suffix_tree import Cursor, SuffixTree, speculate

# The global tree's bound in tokens (each adds up to depth nodes, ~200 bytes each in Python):
# 8,192 tokens at depth 24 are at most ~40 MB, far less where outputs repeat.
GLOBAL_MAX_TOKENS = 8192


@dataclass
class _Local:
    req: Request
    tree: SuffixTree
    cursor: Cursor = field(default_factory=Cursor)
    indexed: int = 0  # the request's tokens already in its tree


class SuffixProposer:
    def __init__(self, depth: int, max_cached_requests: int, max_spec_factor: float, min_token_prob: float):
        self.depth, self.max_cached_requests = depth, max_cached_requests
        self.max_spec_factor, self.min_token_prob = max_spec_factor, min_token_prob
        self.local: dict[str, _Local] = {}
        self.global_tree = SuffixTree(depth)
        self.cached: deque[list[int]] = deque()  # the outputs in the global tree, oldest first
        self.cached_tokens = 0
        self.global_wins = 0  # drafts taken from the global tree (for benches)

    def propose_batch(self, wanted: list[tuple[Request, int]]) -> list[list[int]]:
        return [self.propose(req, k) for req, k in wanted]

    def propose(self, req: Request, k: int) -> list[int]:
        local = self._sync(req)
        args = (k, self.max_spec_factor, self.min_token_prob, self.depth)
        tokens, score = speculate(local.cursor.nodes[::-1], *args)
        if self.cached:
            context = req.all_token_ids[-(self.depth - 1):]
            other, other_score = speculate(self.global_tree.match(context), *args)
            if other_score > score:
                self.global_wins += 1
                return other
        return tokens

    def _sync(self, req: Request) -> _Local:
        """The request's tree, holding every token it has now."""
        local = self.local.get(req.request_id)
        tokens = req.all_token_ids
        if local is None or local.indexed > len(tokens):
            local = self.local[req.request_id] = _Local(req, SuffixTree(self.depth))
        local.req = req
        local.tree.extend(local.cursor, tokens[local.indexed:])
        local.indexed = len(tokens)
        return local

    def clear(self) -> None:
        """Forget every cached output (a benchmark's runs each start with an empty global tree)."""
        self.global_tree, self.cached, self.cached_tokens = SuffixTree(self.depth), deque(), 0

    def release(self, request_id: str) -> None:
        """A request ended: its tree goes, its output joins the global tree."""
        local = self.local.pop(request_id, None)
        if local is None or self.max_cached_requests == 0:
            return
        output = list(local.req.output_token_ids)[:GLOBAL_MAX_TOKENS]
        if not output:
            return
        self.global_tree.add(output)
        self.cached.append(output)
        self.cached_tokens += len(output)
        while len(self.cached) > self.max_cached_requests or self.cached_tokens > GLOBAL_MAX_TOKENS:
            old = self.cached.popleft()
            self.global_tree.remove(old)
            self.cached_tokens -= len(old)
