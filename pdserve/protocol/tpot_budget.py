"""How many prompt tokens a step may prefill without making its decode rows late.

A step that decodes `rows` streams and prefills `p` prompt tokens takes about
base + rows x row + p x token seconds. With a target inter-token latency (TPOT) for the streams,
the prompt tokens a step may take are what the target leaves after the decode rows (vLLM's
max_num_batched_tokens and SGLang's mixed chunk, but derived from the target and from measured
costs instead of fixed). The node measures the three costs from its own steps (StepCostModel);
the router uses the same arithmetic (prefill_tokens_per_step) to estimate how long a prompt
prefilled on a decode node would take (pdserve.router.placement.pd_decision).
"""
from __future__ import annotations

from dataclasses import dataclass

# Steps aim at this share of the target: step times vary (a loaded host, a longer context), and
# a stream's TPOT is the mean of its steps, so a little slack keeps the mean under the target.
TARGET_SHARE = 0.8
# A step always takes at least this many prompt tokens when it prefills at all: a prefill never
# starves, even on a node already at its target (the router then sends prompts elsewhere).
MIN_PREFILL_CHUNK = 16
EMA_WEIGHT = 0.2
# A stream's length, for spreading a prefill's stall over its tokens, is its max_tokens up to this:
# a request that may run to the context's end mostly stops well before it.
STREAM_TOKENS_CAP = 128


@dataclass(frozen=True)
class StepCosts:
    base_s: float = 0.0   # a step's fixed part (launches, sampling)
    row_s: float = 0.0    # each decode row
    token_s: float = 0.0  # each prompt token prefilled in the step (0: not measured yet)

    def step_s(self, rows: int, prefill_tokens: int) -> float:
        return self.base_s + rows * self.row_s + prefill_tokens * self.token_s


def prefill_tokens_per_step(rows: int, costs: StepCosts, itl_s: float, max_tokens: int) -> int:
    """Prompt tokens one step may prefill beside `rows` decode rows so that it ends within the
    ITL target; max_tokens (the step's token budget) when no row needs holding."""
    if rows == 0 or itl_s <= 0:
        return max_tokens
    if costs.token_s <= 0:
        return min(MIN_PREFILL_CHUNK, max_tokens)
    spare = itl_s * TARGET_SHARE - costs.step_s(rows, 0)
    return int(min(max(spare / costs.token_s, MIN_PREFILL_CHUNK), max_tokens))


def has_headroom(rows: int, costs: StepCosts, itl_s: float) -> bool:
    """A minimal prefill chunk still fits beside the decode rows within the target."""
    if rows == 0 or itl_s <= 0:
        return True
    return costs.step_s(rows, MIN_PREFILL_CHUNK) <= itl_s * TARGET_SHARE


def spread_tpot_s(rows: int, costs: StepCosts, prefill_tokens: int, stream_tokens: int) -> float:
    """The mean inter-token time of a node's streams once it decodes one more beside `rows`: its
    steps with one more row, plus the time of prefill_tokens spread over a stream's
    stream_tokens - 1 intervals, however the prefill is chunked."""
    return costs.step_s(rows + 1, 0) + prefill_tokens * costs.token_s / max(stream_tokens - 1, 1)


def absorbs_prefill(rows: int, costs: StepCosts, itl_s: float, prefill_tokens: int, stream_tokens: int) -> bool:
    """A node decoding `rows` streams can also prefill `prefill_tokens` and keep its streams'
    mean inter-token time (TPOT: a stream's decode time over its tokens) within the target share.
    The prefill's time spreads over a stream's stream_tokens - 1 intervals, however it is
    chunked. stream_tokens 0 (unknown): the per-step rule, has_headroom."""
    if rows == 0 or itl_s <= 0:
        return True
    if stream_tokens <= 0:
        return has_headroom(rows, costs, itl_s)
    return spread_tpot_s(rows, costs, prefill_tokens, stream_tokens) <= itl_s * TARGET_SHARE


@dataclass
class StreamClock:
    """One stream's inter-token budget on the node that decodes it. TPOT is the stream's mean:
    steps faster than the target bank time, and the tokens it has left will bank more, at
    (target share - step) each; a prefill may stall it by what is banked and still to bank."""
    target_s: float
    start_s: float       # when its first token here went out (monotonic)
    tokens_left: int     # tokens it may still decode (max_tokens left, at most STREAM_TOKENS_CAP)
    tokens: int = 0      # tokens since start_s

    def allowance_s(self, now_s: float, step_s: float) -> float:
        share = self.target_s * TARGET_SHARE
        banked = share * self.tokens - (now_s - self.start_s)
        return banked + max(self.tokens_left - self.tokens, 0) * (share - step_s)


def least_allowance_s(clocks: list[StreamClock], now_s: float, step_s: float) -> float:
    """The prefill time every one of these streams can still absorb (negative: one is behind)."""
    return min(c.allowance_s(now_s, step_s) for c in clocks)


def amortized_prefill_tokens(clocks: list[StreamClock], now_s: float, rows: int, costs: StepCosts,
                             max_tokens: int) -> int:
    """Prompt tokens one step may prefill so that every stream's mean inter-token time stays
    within its target share over its life (the least allowance among them, at the measured cost
    per prompt token); at least MIN_PREFILL_CHUNK, so a prefill always progresses."""
    if not clocks:
        return max_tokens
    if costs.token_s <= 0:
        return min(MIN_PREFILL_CHUNK, max_tokens)
    allowance = least_allowance_s(clocks, now_s, costs.step_s(rows, 0))
    return int(min(max(allowance / costs.token_s, MIN_PREFILL_CHUNK), max_tokens))


class StepCostModel:
    """Exponentially weighted estimates of StepCosts from (rows, prefill tokens, seconds) of the
    node's own steps. Pure decode steps fit base and row (a weighted least-squares line over
    recent steps; the row cost alone while the batch size has not varied); steps that also
    prefill charge what the decode rows do not explain to their prompt tokens."""

    def __init__(self, weight: float = EMA_WEIGHT):
        self.weight = weight
        self._m = {"n": 0.0, "r": 0.0, "t": 0.0, "rr": 0.0, "rt": 0.0}  # EW moments of decode steps
        self.token_s = 0.0
        self._warmed: set[bool] = set()  # the kinds of step (prefilling or not) seen once

    def observe(self, rows: int, prefill_tokens: int, seconds: float) -> None:
        if seconds <= 0 or rows + prefill_tokens == 0:
            return
        if (kind := prefill_tokens > 0) not in self._warmed:  # its first pays one-time costs (kernels)
            self._warmed.add(kind)
            return
        if prefill_tokens == 0:
            self._observe_decode(rows, seconds)
            return
        rest = seconds - self.decode_s(rows)
        sample = max(rest, 0.1 * seconds) / prefill_tokens  # never a cost of 0 from a noisy residual
        self.token_s = sample if self.token_s == 0 else self.token_s + self.weight * (sample - self.token_s)

    def _observe_decode(self, rows: int, seconds: float) -> None:
        m, w = self._m, self.weight
        sample = {"n": 1.0, "r": rows, "t": seconds, "rr": rows * rows, "rt": rows * seconds}
        for key, value in sample.items():
            m[key] = value if m["n"] == 0 else m[key] + w * (value - m[key])

    def costs(self) -> StepCosts:
        m = self._m
        if m["n"] == 0:
            return StepCosts(token_s=self.token_s)
        var = m["rr"] - m["r"] ** 2
        if var > 0.25:  # the batch size varied: fit the line
            row = max((m["rt"] - m["r"] * m["t"]) / var, 0.0)
            base = max(m["t"] - row * m["r"], 0.0)
            return StepCosts(base, row, self.token_s)
        return StepCosts(0.0, m["t"] / max(m["r"], 1.0), self.token_s)

    def decode_s(self, rows: int) -> float:
        return self.costs().step_s(rows, 0) if rows else 0.0
