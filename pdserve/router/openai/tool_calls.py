"""Chat responses with tools.

  * named tool_choice: the generated text is the call's arguments (held to the tool's parameter
    schema by the grammar) and is returned as `tool_calls`, not `content`. Streamed as OpenAI
    does: a choice's first tool-call delta carries the call's index, id, type and function
    name with the first piece of arguments; later deltas carry arguments only.
  * "required": the grammar holds the output to a JSON list of calls, parsed when it ends.
  * "auto": the model writes text or calls in its template's format (tool_parsers); text
    streams as content until a call may begin, and the calls go out when the choice ends.
Calls made under "required" or "auto" end the choice with finish_reason "tool_calls".
"""
from __future__ import annotations

import uuid
from typing import Any

from pdserve.protocol.outputs import StepOutput
from pdserve.router.openai.responses import ChatFlavor, ChoiceState, TokenTexts
from pdserve.router.openai.tool_parsers import ToolCall, ToolCallParser, required_calls


class ToolCallChatFlavor(ChatFlavor):
    def __init__(self, texts: TokenTexts, want_logprobs: bool, return_token_ids: bool,
                 tool_name: str) -> None:
        super().__init__(texts, want_logprobs, return_token_ids)
        self.tool_name = tool_name
        self._call_ids: dict[int, str] = {}
        self._opened: set[int] = set()

    def call_id(self, index: int) -> str:
        return self._call_ids.setdefault(index, f"call_{uuid.uuid4().hex[:24]}")

    def choice(self, state: ChoiceState) -> dict[str, Any]:
        body = super().choice(state)
        call = {"id": self.call_id(state.index), "type": "function",
                "function": {"name": self.tool_name, "arguments": state.text}}
        body["message"] = {"role": "assistant", "content": None, "tool_calls": [call]}
        return body

    def chunk_choice(self, state: ChoiceState, out: StepOutput) -> dict[str, Any]:
        body = super().chunk_choice(state, out)
        if not out.new_text and state.index in self._opened:
            body["delta"] = {}
            return body
        call: dict[str, Any] = {"index": 0, "function": {"arguments": out.new_text}}
        if state.index not in self._opened:
            self._opened.add(state.index)
            call.update(id=self.call_id(state.index), type="function")
            call["function"]["name"] = self.tool_name
        body["delta"] = {"tool_calls": [call]}
        return body


class ParsedToolCallChatFlavor(ChatFlavor):
    """tool_choice "auto" (parser: the template's format) or "required" (parser None: the
    whole output is the grammar's JSON list of calls)."""

    def __init__(self, texts: TokenTexts, want_logprobs: bool, return_token_ids: bool,
                 parser: ToolCallParser | None) -> None:
        super().__init__(texts, want_logprobs, return_token_ids)
        self.parser = parser
        self.max_calls: int | None = None  # parallel_tool_calls false: 1 (later calls are dropped)
        self._sent: dict[int, int] = {}  # choice index -> characters already sent as content

    def _parse(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.parser is None:
            calls = required_calls(text)
            content = "" if calls else text
        else:
            content, calls = self.parser.extract(text)
        return content, calls[:self.max_calls]

    def choice(self, state: ChoiceState) -> dict[str, Any]:
        body = super().choice(state)
        content, calls = self._parse(state.text)
        if calls:
            body["message"] = {"role": "assistant", "content": content or None,
                               "tool_calls": [c.body() for c in calls]}
            body["finish_reason"] = _calls_finish(state.finish_reason)
        return body

    def chunk_choice(self, state: ChoiceState, out: StepOutput) -> dict[str, Any]:
        body = super().chunk_choice(state, out)
        text = state.text + out.new_text
        sent = self._sent.get(state.index, 0)
        if not out.finished:
            end = 0 if self.parser is None else self.parser.content_end(text)
            end = max(end, sent)
            self._sent[state.index] = end
            body["delta"] = {"content": text[sent:end]} if end > sent else {}
            return body
        content, calls = self._parse(text[sent:])
        delta: dict[str, Any] = {"content": content} if content or not calls else {}
        if calls:
            delta["tool_calls"] = [{"index": i, **c.body()} for i, c in enumerate(calls)]
            body["finish_reason"] = _calls_finish(out.finish_reason)
        body["delta"] = delta
        return body


def _calls_finish(reason: str | None) -> str | None:
    return "tool_calls" if reason == "stop" else reason
