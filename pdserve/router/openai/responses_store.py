"""The router's memory of stored responses, for `previous_response_id` and GET /v1/responses/{id}.

In memory, per router process, bounded: the least recently used response is dropped once
`max_entries` are held (a follow-up or a GET counts as a use). A router restart forgets them
all, and routers behind one load balancer do not share them: a follow-up naming a response
this router does not hold is a 400, as for a response stored with `store: false`.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_ENTRIES = 1024


@dataclass
class StoredResponse:
    body: dict[str, Any]            # the response object, as answered
    messages: list[dict[str, Any]]  # the conversation (without instructions), its output last


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._entries[response_id] = stored
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._entries.get(response_id)
        if stored is not None:
            self._entries.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._entries)
