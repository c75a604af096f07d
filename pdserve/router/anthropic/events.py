"""A Messages API message and its stream of events, built from the chat path's deltas.

The chat flavors turn a generation into chat deltas (`content` pieces, and `tool_calls` pieces
whose first names the call); `MessageEvents` turns those into content blocks and Anthropic's
events, so the streamed and the whole answer share one translation:

  message_start (the message, empty, with the prompt's usage)
  per text block:      content_block_start, content_block_delta (text_delta)..., content_block_stop
  per tool_use block:  content_block_start (id, name, input {}), content_block_delta
                       (input_json_delta: pieces of the input's JSON)..., content_block_stop
  message_delta (stop_reason, stop_sequence, usage), message_stop

message_start waits for the first delta: the nodes report how much of the prompt their caches
served with it, and that is the usage's `cache_read_input_tokens`.
"""
from __future__ import annotations

import copy
import json
from typing import Any

# Chat finish reasons as Anthropic's stop reasons ("stop" is end_turn, or stop_sequence when a
# stop sequence ended it; see MessageEvents.stop_reason).
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def messages_usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, Any]:
    """As Anthropic counts: input_tokens is the prompt less what the caches served (cache reads),
    so input_tokens + cache_read_input_tokens is the whole prompt. Nothing is written to a cache
    on request (pdserve caches every prompt's blocks), so cache_creation_input_tokens is 0."""
    cached = min(cached_tokens, prompt_tokens)
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the tool_use block's input (an object; any other text is kept whole
    under "arguments", so nothing the model wrote is lost)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


class MessageEvents:
    """base: the message's fields that do not change as it is generated (id, model)."""

    def __init__(self, base: dict[str, Any]) -> None:
        self.base = base
        self.blocks: list[dict[str, Any]] = []
        self._arguments: dict[int, str] = {}   # tool_use block index -> its input's JSON so far
        self._calls: dict[int, int] = {}       # chat tool-call index -> its block index
        self._open: int | None = None          # the block being written
        self.started = False

    def message(self, stop_reason: str | None, stop_sequence: str | None, usage: dict[str, Any]) -> dict[str, Any]:
        content = copy.deepcopy(self.blocks)
        for index, arguments in self._arguments.items():
            content[index]["input"] = _input(arguments)
        return {**self.base, "type": "message", "role": "assistant", "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    def start(self, usage: dict[str, Any]) -> list[dict[str, Any]]:
        if self.started:
            return []
        self.started = True
        message = {**self.base, "type": "message", "role": "assistant", "content": [], "stop_reason": None,
                   "stop_sequence": None, "usage": usage}
        return [{"type": "message_start", "message": message}]

    def delta(self, chat_delta: dict[str, Any]) -> list[dict[str, Any]]:
        """Events for one chat delta ({"content": ..., "tool_calls": [...]}, either may be absent)."""
        events: list[dict[str, Any]] = []
        text = chat_delta.get("content")
        if text:
            if self._open is None or self.blocks[self._open]["type"] != "text":
                events += self._open_block({"type": "text", "text": ""})
            self.blocks[self._open]["text"] += text
            events.append({"type": "content_block_delta", "index": self._open,
                           "delta": {"type": "text_delta", "text": text}})
        for call in chat_delta.get("tool_calls") or []:
            events += self._call_delta(call)
        return events

    def closing(self, stop_reason: str, stop_sequence: str | None, usage: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close_block()
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        return events + [{"type": "message_delta", "delta": delta, "usage": usage}, {"type": "message_stop"}]

    def stop_reason(self, finish_reason: str | None, stop_sequence: str | None) -> str:
        if finish_reason in _STOP_REASONS:
            return _STOP_REASONS[finish_reason]
        if self._arguments:  # a named tool_choice ends with "stop" after its one call
            return "tool_use"
        return "stop_sequence" if stop_sequence is not None else "end_turn"

    def _open_block(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close_block()
        self.blocks.append(block)
        self._open = len(self.blocks) - 1
        return events + [{"type": "content_block_start", "index": self._open, "content_block": copy.deepcopy(block)}]

    def _close_block(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        return [{"type": "content_block_stop", "index": index}]

    def _call_delta(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        function = call.get("function") or {}
        index = self._calls.get(call.get("index", 0))
        if index is None:  # a call's first delta names it
            events += self._open_block({"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}})
            index = self._calls[call.get("index", 0)] = self._open
            self._arguments[index] = ""
        arguments = function.get("arguments") or ""
        if arguments:
            self._arguments[index] += arguments
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "input_json_delta", "partial_json": arguments}})
        return events
