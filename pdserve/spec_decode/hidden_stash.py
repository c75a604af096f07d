"""The target's hidden states that a drafting head (EAGLE, MTP) has not consumed yet.

The target model runner hands over every step's hidden states (ModelRunner.set_hidden_sink); the
stash keeps, per request, the rows of consecutive positions [start, start + n). A step's rows
start at the request's num_computed_tokens: a chunk that continues the stash (or overwrites its
tail: rejected drafts, whose positions the next step computes again) is appended; one that
starts after a gap (a prefix-cache hit, KV handed over by a prefill node) or before the stash
(a preempted request computed again) replaces it. Rows past the request's committed tokens are
rejected drafts: the head never reads them (HeadProposer asks for positions below
num_computed_tokens only).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.engine.request import Request


class HiddenStash:
    def __init__(self, wanted: Callable[[Request], bool]):
        self.wanted = wanted  # requests that may ever draft: the others' rows are not kept
        self.rows: dict[str, tuple[int, torch.Tensor]] = {}  # request id -> (first position, [n, hidden])

    def record(self, items: list[tuple[Request, int]], hidden: torch.Tensor) -> None:
        """items: the step's (request, new tokens) in the order of hidden's rows."""
        row = 0
        for req, n in items:
            if self.wanted(req):
                self._add(req.request_id, req.num_computed_tokens, hidden[row:row + n].clone())
            row += n

    def _add(self, rid: str, start: int, rows: torch.Tensor) -> None:
        old = self.rows.get(rid)
        if old is not None and old[0] <= start <= old[0] + len(old[1]):
            rows = torch.cat([old[1][:start - old[0]], rows])
            start = old[0]
        self.rows[rid] = (start, rows)

    def take(self, rid: str, end: int) -> tuple[int, torch.Tensor] | None:
        """(first position, rows up to position end excluded), removed from the stash; None when
        nothing is kept for positions before end."""
        got = self.rows.pop(rid, None)
        if got is None or got[0] >= end or got[0] + len(got[1]) < end:
            return None
        return got[0], got[1][:end - got[0]]

    def drop(self, rid: str) -> None:
        self.rows.pop(rid, None)
