"""Verification of drafted tokens against the target's logits.

Every draft here is deterministic (n-gram lookup, a draft model's argmax): its distribution q
is one-hot on the drafted token x. Leviathan et al.'s rule then accepts x with probability
min(1, p(x) / q(x)) = p(x), and on rejection draws from norm(max(p - q, 0)), which is p with
x removed. Drawing the target's own token t ~ p at the position and accepting x iff t == x is
that same rule: P(accept) = p(x), and t given t != x follows p without x. So each row is
sampled exactly as a plain decode step would sample it (same filters, same seeded generator
per output position), and the output is the longest drafted prefix the target agreed with,
plus the target's token at the first disagreement (or after the last draft). Greedy requests
thus get the very tokens decoding without speculation gives, and seeded ones too.
"""
from __future__ import annotations


def accepted_length(drafts: list[int], target: list[int]) -> int:
    """Leading drafts equal to the target's tokens at their positions."""
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    return n
