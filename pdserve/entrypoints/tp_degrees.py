"""Each pool's tensor- and pipeline-parallel degrees for `pdserve up` (--prefill-tp,
--decode-tp, --prefill-pp, --decode-pp).

One number gives every node of the pool that degree. A comma list gives the pool's nodes their
degrees in the order they start: node i (prefill-i, decode-i) runs at the list's entry i mod its
length, so `--decode-nodes 3 --decode-tp 1,2` runs decode-0 at TP 1, decode-1 at TP 2 and
decode-2 at TP 1, and a node added by scaling continues the cycle. A restarted node keeps its
degree (its command line is kept). Mixed pools let one cluster hand KV over between every pair
of degrees; on Ray a pool has one degree (its nodes share one template and one placement shape).
The pipeline degrees (stages) cycle the same way, on their own list; a node runs TP x PP ranks.
"""
from __future__ import annotations

import argparse

ROLES = ("prefill", "decode")


def parse_degrees(text: str) -> tuple[int, ...]:
    """argparse type: "2" -> (2,), "1,2" -> (1, 2); each degree a positive integer."""
    try:
        degrees = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a degree or a comma list of degrees (2, or 1,2), not {text!r}") from None
    if any(d < 1 for d in degrees):
        raise argparse.ArgumentTypeError(f"a parallel degree is at least 1, not {text!r}")
    return degrees


def _degrees(args, role: str, kind: str = "tp") -> tuple[int, ...]:
    value = getattr(args, f"{role}_{kind}", None) or 1
    return (value,) if isinstance(value, int) else tuple(value)


def node_degree(args, role: str, index: int) -> int:
    """The TP degree of the pool's node number `index` (0 for the pool's first node)."""
    degrees = _degrees(args, role)
    return degrees[index % len(degrees)]


def node_stages(args, role: str, index: int) -> int:
    """The pipeline degree (stages) of the pool's node number `index`."""
    stages = _degrees(args, role, "pp")
    return stages[index % len(stages)]


def node_ranks(args, role: str, index: int) -> int:
    """The processes node `index` of the pool runs: TP ranks on each of its stages."""
    return node_degree(args, role, index) * node_stages(args, role, index)


def node_parallel_flags(args, role: str, index: int) -> list[str]:
    """The node's command-line flags for its degrees (none at 1)."""
    tp, pp = node_degree(args, role, index), node_stages(args, role, index)
    return ((["--tensor-parallel-size", str(tp)] if tp > 1 else [])
            + (["--pipeline-parallel-size", str(pp)] if pp > 1 else []))


def pool_ranks(args, role: str, nodes: int) -> int:
    """How many processes the pool's first `nodes` nodes run, all ranks counted."""
    return sum(node_ranks(args, role, i) for i in range(nodes))


def pool_degree(args, role: str, kind: str = "tp") -> int:
    """The one degree of every node of the pool; a ValueError for a mixed pool (--ray needs one)."""
    degrees = set(_degrees(args, role, kind))
    if len(degrees) > 1:
        what = "tensor-parallel" if kind == "tp" else "pipeline-parallel"
        raise ValueError(f"--{role}-{kind} {','.join(map(str, _degrees(args, role, kind)))}: on --ray each pool "
                         f"has one {what} degree (its nodes share one template and placement shape)")
    return degrees.pop()
