"""Synthetic chat traces for the simulator: shared system prompts plus multi-round sessions.

Each session opens with one of a few system prompts (shared across sessions, as a product's
fixed instructions are) and a first user message, then each round resends the whole
conversation plus a new turn. Sessions start as a Poisson process; a user thinks for an
exponential time between a reply and the next turn. Token ids come from a seeded generator, so
a trace is the same on every machine.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class TraceConfig:
    sessions: int = 200
    rounds: int = 4
    system_prompts: int = 4
    system_prompt_tokens: int = 512
    first_turn_tokens: int = 64
    turn_tokens: int = 32
    output_tokens: int = 32
    arrival_rate: float = 4.0     # new sessions per second
    think_time_s: float = 1.0     # mean pause between a reply and the next turn; 0: at once
    vocab: int = 250
    seed: int = 0


@dataclass
class Session:
    session_id: int
    start_s: float
    system: list[int]
    turns: list[list[int]]        # each round's new user tokens
    outputs: list[list[int]]      # each round's reply (the simulator's stand-in for the model's)
    think_s: list[float] = field(default_factory=list)  # pause before each round after the first

    def prompt(self, round_index: int) -> list[int]:
        """The token ids sent in round `round_index`: the history so far plus the new turn."""
        ids = list(self.system)
        for turn, out in zip(self.turns[:round_index], self.outputs[:round_index]):
            ids += turn + out
        return ids + self.turns[round_index]


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def make_trace(cfg: TraceConfig) -> list[Session]:
    rng = random.Random(cfg.seed)
    systems = [_tokens(rng, cfg.system_prompt_tokens, cfg.vocab) for _ in range(cfg.system_prompts)]
    sessions, t = [], 0.0
    for sid in range(cfg.sessions):
        t += rng.expovariate(cfg.arrival_rate) if cfg.arrival_rate > 0 else 0.0
        turns = [_tokens(rng, cfg.first_turn_tokens if r == 0 else cfg.turn_tokens, cfg.vocab)
                 for r in range(cfg.rounds)]
        outputs = [_tokens(rng, cfg.output_tokens, cfg.vocab) for _ in range(cfg.rounds)]
        think = [rng.expovariate(1 / cfg.think_time_s) if cfg.think_time_s > 0 else 0.0
                 for _ in range(cfg.rounds)]
        sessions.append(Session(sid, t, systems[sid % len(systems)], turns, outputs, think))
    return sessions
