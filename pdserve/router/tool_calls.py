"""Chat responses for a named tool_choice: the generated text is the call's arguments (held to
the tool's parameter schema by the grammar) and is returned as `tool_calls`, not `content`.

Streaming follows OpenAI: a choice's first tool-call delta carries the call's index, id, type
and function name with the first piece of arguments; later deltas carry arguments only.
"""
from __future__ import annotations

import uuid
from typing import Any

from pdserve.engine.outputs import StepOutput
from pdserve.router.responses import ChatFlavor, ChoiceState, TokenTexts


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
