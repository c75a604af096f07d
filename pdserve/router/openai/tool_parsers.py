"""Tool calls parsed out of generated text, in the format the model's chat template teaches.

With tool_choice "auto" the model may answer in text or call tools; each model family writes
its calls its own way. The parser is chosen with --tool-call-parser, or from the chat template:
  * hermes (Qwen 2.5/3, Hermes, many fine-tunes): <tool_call>{"name": .., "arguments": {..}}</tool_call>
  * llama3_json (Llama 3.1+): the whole answer is {"name": .., "parameters": {..}}, optionally
    after <|python_tag|>, several separated by ";"
  * mistral: [TOOL_CALLS][{"name": .., "arguments": {..}}, ...]
A parser also says how much of a growing text is surely not part of a call, so a stream can
send that text as content and hold back only what may become a call.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

PARSERS = ("hermes", "llama3_json", "mistral")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def body(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call(obj: Any, argument_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = next((obj[k] for k in argument_keys if k in obj), {})
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(obj["name"], text)


def _held_tail(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    name = ""
    marker = ""

    def content_end(self, text: str) -> int:
        """How many leading characters of a growing output are content for sure."""
        at = text.find(self.marker)
        return at if at >= 0 else len(text) - _held_tail(text, self.marker)

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        """(the content outside the calls, the calls); no calls when none parse."""
        raise NotImplementedError


class HermesParser(ToolCallParser):
    name = "hermes"
    marker = "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        calls: list[ToolCall | None] = []
        blocks = self._CALL.findall(text)
        for i, (body, closed) in enumerate(blocks):
            try:
                found = json.loads(body)
            except ValueError:
                if calls and not closed and i == len(blocks) - 1:
                    break  # the last of several calls, cut off by max_tokens: the whole ones stand
                return text, []  # a malformed call: the client gets the text as it is
            # One call per block, or a list of them (SmolLM2's and APIGen's format).
            calls += [_call(obj, ("arguments", "parameters")) for obj in (found if isinstance(found, list) else [found])]
            if None in calls:
                return text, []
        if not calls:
            return text, []
        return self._CALL.sub("", text).strip(), calls


class MistralParser(ToolCallParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        at = text.find(self.marker)
        if at < 0:
            return text, []
        body = text[at + len(self.marker):].strip()
        try:
            found = json.loads(body)
        except ValueError:
            found = _array_items(body)  # several calls cut off by max_tokens: the whole ones
            if not found:
                return text, []
        calls = [_call(obj, ("arguments", "parameters")) for obj in (found if isinstance(found, list) else [found])]
        if not calls or None in calls:
            return text, []
        return text[:at].strip(), calls


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    marker = "<|python_tag|>"

    def content_end(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or stripped.startswith("{") or self.marker.startswith(stripped[:len(self.marker)]):
            return 0  # the answer may be a call: hold it all
        return len(text)

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip().removeprefix(self.marker).strip()
        calls = []
        parts = body.split(";")
        for i, part in enumerate(parts):
            try:
                call = _call(json.loads(part), ("parameters", "arguments"))
            except ValueError:
                if calls and i == len(parts) - 1:
                    break  # the last of several calls, cut off by max_tokens: the whole ones stand
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return "", calls


_BY_NAME = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def parser_for(name: str | None, chat_template: str | None) -> ToolCallParser:
    """The named parser, or the one the chat template's tool-call format calls for."""
    if name:
        if name not in _BY_NAME:
            raise ValueError(f"unknown tool-call parser {name!r}; choose from {', '.join(PARSERS)}")
        return _BY_NAME[name]()
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return MistralParser()
    if "<tool_call>" not in template and ("<|python_tag|>" in template or "<|eom_id|>" in template):
        return Llama3JsonParser()
    return HermesParser()


def required_calls(text: str) -> list[ToolCall]:
    """Calls from tool_choice "required" output: the grammar's [{"name", "parameters"}, ...].
    An array cut short (max_tokens) gives the calls it holds whole."""
    calls = [_call(obj, ("parameters",)) for obj in _array_items(text)]
    return [] if None in calls else calls


def _array_items(text: str) -> list[Any]:
    """The complete items of a JSON array, which may be cut off anywhere after its items."""
    decoder = json.JSONDecoder()
    at = len(text) - len(text.lstrip())
    if not text.startswith("[", at):
        return []
    items: list[Any] = []
    at += 1
    while True:
        at += len(text[at:]) - len(text[at:].lstrip())
        if text.startswith("]", at) or at >= len(text):
            return items
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            return items  # cut off inside this item
        items.append(item)
        at += len(text[at:]) - len(text[at:].lstrip())
        if text.startswith(",", at):
            at += 1
