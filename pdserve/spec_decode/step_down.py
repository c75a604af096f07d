"""Dynamic speculation: how many drafts each request gets this step, so that speculation pays at
one request and does not cost throughput under load (vLLM's `disable_by_batch_size`, and a
per-request rule in the spirit of its dynamic speculative decoding).

Why it is needed: a draft is one more query row of the step. At one request the step's cost is
mostly the fixed part (reading the weights once), so a row is cheap beside the token it may
win; as the batch grows the step becomes compute-bound, every row costs about what a plain
decode row costs, and a draft pays only if it is nearly always accepted.

The rule: with `rows` query rows in the step before drafting, a draft at position i (1-based)
is worth its row when the chance it is accepted, q**i (q: the request's measured acceptance of
one draft given the ones before it were accepted), is at least rows / (rows + FIXED_ROWS):
the share of a step's cost that one more row adds, over the tokens a plain step yields per
row. FIXED_ROWS is the fixed part of a step counted in rows: on SmolLM2 Q4_1 with the compiled
CPU step, a one-token step cost 33.7 ms and each further row ~6 ms at one request (about 5
rows), and ~13 rows' worth at eight (docs/speculative-decoding.md, "Where the time goes").
`disable_by_batch_size` (vLLM's key) turns drafting off outright from that many decoding
requests on. Only how many tokens are proposed changes, never how they are verified: the output
stays exactly that of decoding without speculation.
"""
from __future__ import annotations

FIXED_ROWS = 8.0
# A request starts trusted (drafts are cheap to try once) and its estimate moves by this
# weight per draft position tried: a few steps of rejections turn it down.
EMA_WEIGHT = 0.25
# A request turned down to no drafts still tries one now and then, so a request whose text turns
# repetitive later (a copy after a preamble) is noticed: every PROBE_EVERY steps alone, more
# rarely in a larger step, where a probe's row costs more (at 32 rows, one request in 136 steps:
# under 1% more rows when every probe is rejected).
PROBE_EVERY = 8
PROBE_STEPS_PER_ROW = 4


def probe_interval(rows: int) -> int:
    return PROBE_EVERY + PROBE_STEPS_PER_ROW * rows


class StepDown:
    def __init__(self, k: int, disable_by_batch_size: int | None = None):
        self.k, self.disable_by_batch_size = k, disable_by_batch_size
        self.fixed_rows = FIXED_ROWS  # (inf: every request drafts k, as before the step-down)
        self.acceptance: dict[str, float] = {}  # request id -> q, per draft position
        self.idle_steps: dict[str, int] = {}    # request id -> steps since its last draft
        self.steps_disabled = 0  # steps whose batch size turned drafting off (for tests, benches)

    def step_disabled(self, num_decoding: int) -> bool:
        """True when this step's decoding requests are too many to draft for at all."""
        limit = self.disable_by_batch_size
        if limit is not None and num_decoding >= limit:
            self.steps_disabled += 1
            return True
        return False

    def draft_len(self, request_id: str, rows: int, cap: int) -> int:
        """Drafts to propose for a request in a step of `rows` rows (cap: its own limit)."""
        q = self.acceptance.get(request_id, 1.0)
        threshold = rows / (rows + self.fixed_rows)
        n, chance = 0, q
        while n < min(self.k, cap) and chance >= threshold:
            n, chance = n + 1, chance * q
        if n == 0 and cap > 0:
            idle = self.idle_steps.get(request_id, 0) + 1
            self.idle_steps[request_id] = idle
            if idle >= probe_interval(rows):
                n = 1
        if n:
            self.idle_steps[request_id] = 0
        return n

    def record(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """A drafted step's outcome: positions tried are the accepted ones and the first rejected."""
        q = self.acceptance.get(request_id, 1.0)
        tried = num_accepted + (1 if num_accepted < num_drafted else 0)
        for i in range(tried):
            q += EMA_WEIGHT * ((1.0 if i < num_accepted else 0.0) - q)
        self.acceptance[request_id] = q

    def release(self, request_id: str) -> None:
        self.acceptance.pop(request_id, None)
        self.idle_steps.pop(request_id, None)
