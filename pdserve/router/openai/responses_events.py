"""A response object and its stream of events, built from the chat path's deltas.

The chat flavors (plain text, a named tool, tool_choice "required" or "auto" with its parser)
already turn a generation into chat deltas: `content` pieces and `tool_calls` pieces (the first
piece of a call carries its id and name). `ResponseEvents` turns those into the Responses
API's output items and events, so both paths, streamed and not, share one translation:

  response.created, response.in_progress,
  per message:  output_item.added, content_part.added, output_text.delta..., output_text.done,
                content_part.done, output_item.done
  per call:     output_item.added, function_call_arguments.delta..., function_call_arguments.done,
                output_item.done
  response.completed (or response.incomplete when max_output_tokens ran out)

Every event carries `sequence_number`, counting from 0.
"""
from __future__ import annotations

import copy
import time
import uuid
from typing import Any

from pdserve.router.openai.errors import APIError
from pdserve.router.openai.responses import ChoiceState


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def responses_usage(prompt_tokens: int, state: ChoiceState) -> dict[str, Any]:
    output = len(state.token_ids)
    return {"input_tokens": prompt_tokens, "output_tokens": output, "total_tokens": prompt_tokens + output,
            "input_tokens_details": {"cached_tokens": state.num_cached_tokens, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


class ResponseEvents:
    """base: the response object's fields that do not change as it is generated (id, model,
    the request's settings)."""

    def __init__(self, base: dict[str, Any]) -> None:
        self.base = base
        self.items: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None   # the message item being written
        self._calls: dict[int, dict[str, Any]] = {}   # chat tool-call index -> its open item
        self._sequence = 0
        self.final: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def response(self, status: str, usage: dict[str, Any] | None = None,
                 incomplete: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        body = {**self.base, "status": status, "output": copy.deepcopy(self.items), "usage": usage,
                "incomplete_details": {"reason": incomplete} if incomplete else None, "error": error}
        if status != "in_progress":
            body["completed_at"] = int(time.time())
        return body

    def opening(self) -> list[dict[str, Any]]:
        response = self.response("in_progress")
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def delta(self, chat_delta: dict[str, Any]) -> list[dict[str, Any]]:
        """Events for one chat delta ({"content": ..., "tool_calls": [...]}, either may be absent)."""
        events: list[dict[str, Any]] = []
        content = chat_delta.get("content")
        if content:
            events += self._open_message()
            part = self._message["content"][0]
            part["text"] += content
            events.append(self._event("response.output_text.delta", item_id=self._message["id"],
                                      output_index=self._index(self._message), content_index=0, delta=content,
                                      logprobs=[]))
        for call in chat_delta.get("tool_calls") or []:
            events += self._call_delta(call)
        return events

    def closing(self, finish_reason: str | None, usage: dict[str, Any]) -> list[dict[str, Any]]:
        """Closes every open item (an answer with neither text nor calls gets an empty message)
        and ends the stream with response.completed or response.incomplete."""
        incomplete = "max_output_tokens" if finish_reason == "length" else None
        status = "incomplete" if incomplete else "completed"
        events = [] if self.items else self._open_message()
        if self._message is not None:
            events += self._close_message(status)
        for item in self._calls.values():
            events += self._close_call(item, status)
        self._calls.clear()
        self.final = self.response(status, usage, incomplete)
        kind = "response.incomplete" if incomplete else "response.completed"
        return events + [self._event(kind, response=self.final)]

    def failure(self, err: APIError) -> list[dict[str, Any]]:
        """An error mid-generation: an `error` event (its own code), then response.failed, whose
        error.code is one of the few OpenAI's Response allows (server_error for a node's failure)."""
        error = {"code": "server_error" if err.status >= 500 else "invalid_prompt", "message": err.message,
                 "type": err.type, "param": err.param}
        return [self._event("error", code=err.code or err.type, message=err.message, param=err.param),
                self._event("response.failed", response=self.response("failed", error=error))]

    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, it in enumerate(self.items) if it is item)

    def _open_message(self) -> list[dict[str, Any]]:
        if self._message is not None:
            return []
        item = {"type": "message", "id": _item_id("msg"), "status": "in_progress", "role": "assistant",
                "content": []}
        self.items.append(item)
        self._message = item
        index = len(self.items) - 1
        added = self._event("response.output_item.added", output_index=index, item=copy.deepcopy(item))
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        return [added, self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part=copy.deepcopy(part))]

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        item, self._message = self._message, None
        assert item is not None
        index, part = self._index(item), item["content"][0]
        item["status"] = status
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [self._event("response.output_text.done", **where, text=part["text"], logprobs=[]),
                self._event("response.content_part.done", **where, part=copy.deepcopy(part)),
                self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]

    def _call_delta(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        function = call.get("function") or {}
        item = self._calls.get(call.get("index", 0))
        if item is None:  # a call's first delta names it; text before it is finished
            if self._message is not None:
                events += self._close_message("completed")
            item = {"type": "function_call", "id": _item_id("fc"), "call_id": call["id"],
                    "name": function["name"], "arguments": "", "status": "in_progress"}
            self.items.append(item)
            self._calls[call.get("index", 0)] = item
            events.append(self._event("response.output_item.added", output_index=len(self.items) - 1,
                                      item=copy.deepcopy(item)))
        arguments = function.get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self._index(item), delta=arguments))
        return events

    def _close_call(self, item: dict[str, Any], status: str) -> list[dict[str, Any]]:
        item["status"] = status
        index = self._index(item)
        return [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            arguments=item["arguments"], name=item["name"]),
                self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]

    def assistant_message(self) -> dict[str, Any]:
        """The output as a chat turn, for the conversation a follow-up continues."""
        text = "".join(part["text"] for item in self.items if item["type"] == "message"
                       for part in item["content"])
        message: dict[str, Any] = {"role": "assistant", "content": text}
        calls = [{"id": item["call_id"], "type": "function",
                  "function": {"name": item["name"], "arguments": item["arguments"]}}
                 for item in self.items if item["type"] == "function_call"]
        if calls:
            message["tool_calls"] = calls
        return message
