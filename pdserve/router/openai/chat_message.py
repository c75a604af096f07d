"""A chat message as OpenAI's chat API takes it, and the per-role rules on its content, which the
validator enforces and the OpenAPI document states (as JSON Schema if/then on `role`), so clients
generated from the document, and fuzzers, send only messages the server takes."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from pdserve.router.openai.content_parts import ContentPart
from pdserve.router.openai.media import ImageRef

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]

_GIVEN = {"type": ["string", "array"]}  # content present and not null
_CONTENT_REQUIRED = {"required": ["content"], "properties": {"content": _GIVEN}}


def _role_is(*roles: str) -> dict[str, Any]:
    return {"properties": {"role": {"enum": list(roles)}}}


# The validator's rules, one if/then per role group (role is required, so `if` always applies).
MESSAGE_RULES: list[dict[str, Any]] = [
    {"if": _role_is("system", "developer", "user", "tool"), "then": _CONTENT_REQUIRED},
    {"if": _role_is("assistant"), "then": {"anyOf": [
        _CONTENT_REQUIRED,
        {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}},
        {"required": ["function_call"], "properties": {"function_call": {"type": "object", "minProperties": 1}}}]}},
    {"if": _role_is("function"),
     "then": {"required": ["name", "content"], "properties": {"name": {"type": "string", "minLength": 1}}}},
]


class ChatMessage(BaseModel):
    """OpenAI's rules: content is required, except that an assistant turn that called tools
    (tool_calls, or the older function_call) may omit it. A function turn may send null, but
    must send content and the function's name."""
    model_config = ConfigDict(extra="allow", json_schema_extra={"allOf": MESSAGE_RULES})
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    @model_validator(mode="after")
    def _content_where_required(self) -> ChatMessage:
        if self.role == "function":
            if not self.name or "content" not in self.model_fields_set:
                raise ValueError("a function message needs name and content")
            return self
        called = self.tool_calls or (self.model_extra or {}).get("function_call")
        if self.content is None and not (self.role == "assistant" and called):
            unless = " unless it has tool_calls" if self.role == "assistant" else ""
            raise ValueError(f"a message with role {self.role!r} needs content{unless}")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content if part.type == "text")

    def template_parts(self) -> list[dict[str, str]]:
        """The content's parts in order, as a chat template takes them."""
        return [{"type": "text", "text": part.text or ""} if part.type == "text" else {"type": "image"}
                for part in self.content]

    def image_refs(self, index: int) -> list[ImageRef]:
        """This message's image parts; `index`: the message's, for the parts' params."""
        if not isinstance(self.content, list):
            return []
        return [ImageRef(part.url, part.source_param or f"messages[{index}].content[{j}].image_url", part.detail)
                for j, part in enumerate(self.content) if part.type == "image_url"]
