"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the request's
last n tokens (n from prompt_lookup_max down to prompt_lookup_min), in its own prompt and
output. No second model; a request with no match gets no draft and decodes normally."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, lookup_min: int, lookup_max: int):
        self.lookup_min, self.lookup_max = lookup_min, lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k draft tokens to follow token_ids ([] when no n-gram matches)."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        for n in range(min(self.lookup_max, length - 1), self.lookup_min - 1, -1):
            # Windows starting before the suffix itself: the match must be followed by a token.
            windows = sliding_window_view(tokens[:length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the latest occurrence: nearest to what is being copied
                return tokens[start:start + k].tolist()
        return []

    def propose_batch(self, wanted) -> list[list[int]]:
        """wanted: (request, k) pairs; the drafts for each."""
        return [self.propose(req.all_token_ids, k) for req, k in wanted]
