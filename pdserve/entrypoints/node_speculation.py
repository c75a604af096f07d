"""`pdserve up --speculative-config`: one JSON object for every decode node, or a JSON list that
gives the decode nodes theirs in turn (decode-i: entry i mod the list's length; null: no
speculation on that node), as --decode-tp does for tensor-parallel degrees."""
from __future__ import annotations

import json

from pdserve.engine.speculative_config import parse_speculative_config


def _entries(value: str | None) -> list | None:
    """The list's entries, or None when value is not a JSON list (one config, or none)."""
    try:
        parsed = json.loads(value) if value else None
    except json.JSONDecodeError:
        return None  # the node's parser says what is wrong with it (check_speculative_configs first)
    return parsed if isinstance(parsed, list) else None


def node_speculative_config(value: str | None, index: int) -> str | None:
    """Decode node `index`'s --speculative-config (None: none)."""
    entries = _entries(value)
    if entries is None:
        return value or None
    entry = entries[index % len(entries)]
    return None if entry is None else json.dumps(entry)


def check_speculative_configs(value: str | None) -> None:
    """Refuse a bad --speculative-config (each entry of a list) before any node starts."""
    entries = _entries(value)
    if entries == []:
        raise ValueError("--speculative-config: an empty list; give a config object, or null for a node without")
    for entry in [value] if entries is None else entries:
        parse_speculative_config(entry)


def pool_speculative_config(value: str | None) -> str | None:
    """The one config of every decode node; a ValueError for a list of different ones (--ray
    starts every decode node from one template)."""
    entries = _entries(value)
    if entries is not None and len({json.dumps(e, sort_keys=True) for e in entries}) > 1:
        raise ValueError("--speculative-config with different configs per decode node: on --ray every decode "
                         "node has the same one")
    return node_speculative_config(value, 0)
