"""POST /v1/messages' body (Anthropic's Messages API), and the chat request it becomes.

The Messages API is served by the chat-completions path (chat template, tools, structured
outputs, the P/D backend), so its request is translated here:
  * `system` (a string or text blocks): a system turn first;
  * `messages`: user and assistant turns whose `content` is a string or content blocks (a last
    assistant turn is a prefill: the answer continues its text, after the rendered prompt):
    `text`; `image` (a base64 or URL source, which becomes a chat `image_url` part); in an
    assistant turn `tool_use` (a tool call: its `input` becomes the call's arguments) and
    `thinking` (dropped: the served model does not reason); in a user turn `tool_result` (a
    `tool` turn answering the call with that id, put before the turn's other content);
  * `tools` (`name`, `description`, `input_schema`) as chat function tools, and `tool_choice`
    `auto | any | tool | none` as chat's "auto", "required", a named function and "none";
    `disable_parallel_tool_use` as `parallel_tool_calls: false`;
  * `max_tokens`, `stop_sequences` (chat's `stop`), `temperature`, `top_p`, `top_k`,
    `metadata.user_id` (chat's `user`, which keys the session), `output_config.format` (a JSON
    schema the answer is held to, chat's `response_format`).
A few vLLM sampling fields a client may add (with the SDK's `extra_body`) go to the chat request
too (CHAT_EXTRAS); other unknown fields are accepted, not acted on, and named in the response's
`X-Ignored-Fields` header.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pdserve.router.openai.schemas import INT64_MAX, UnicodeCheckedRequest

# vLLM's sampling fields, passed on to the chat request when a client sends them.
CHAT_EXTRAS = ("seed", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "cache_salt",
               "ignore_eos", "min_tokens", "stop_token_ids")
_SKIPPED_BLOCKS = ("thinking", "redacted_thinking")  # an earlier answer's reasoning: nothing to render


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class ConversationRequest(UnicodeCheckedRequest):
    """The fields /v1/messages and /v1/messages/count_tokens share: what the prompt is made of."""
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None

    @field_validator("thinking")
    @classmethod
    def _no_thinking(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value and value.get("type") not in (None, "disabled"):
            raise ValueError("extended thinking is not supported: the served model does not reason "
                             "(send thinking {'type': 'disabled'} or leave it out)")
        return value

    @property
    def ignored_fields(self) -> list[str]:
        return sorted(k for k in self.model_extra or {} if k not in CHAT_EXTRAS)

    def chat_messages(self) -> list[dict[str, Any]]:
        """The system prompt and the turns as chat messages (ValueError when malformed)."""
        out: list[dict[str, Any]] = []
        if self.system:
            out.append({"role": "system", "content": _text(self.system, "system")})
        for i, message in enumerate(self.messages):
            where = f"messages[{i}].content"
            if isinstance(message.content, str):
                out.append({"role": message.role, "content": message.content})
            elif message.role == "assistant":
                out.append(_assistant_turn(message.content, where))
            else:
                out += _user_turns(message.content, where)
        if self.messages[-1].role == "assistant":
            out.pop()  # the prefill: the answer continues it (prefill())
        return out

    def prefill(self) -> str:
        """The text of a last assistant turn, which the answer continues ("" without one)."""
        last = self.messages[-1]
        if last.role != "assistant":
            return ""
        if isinstance(last.content, str):
            return last.content
        if any(_block_kind(b, "messages[-1].content") != "text" for b in last.content):
            raise ValueError(f"messages[{len(self.messages) - 1}].content: a last assistant turn (a prefill the "
                             "answer continues) takes text blocks only")
        return "".join(block["text"] for block in last.content)

    def chat_fields(self) -> dict[str, Any]:
        """The chat request (ValueError when malformed)."""
        fields: dict[str, Any] = {"model": self.model, "messages": self.chat_messages(),
                                  "tools": chat_tools(self.tools)}
        fields.update(chat_tool_choice(self.tool_choice))
        return {k: v for k, v in fields.items() if v is not None}


class MessagesRequest(ConversationRequest):
    max_tokens: int = Field(ge=1, le=INT64_MAX)
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = Field(None, ge=0, le=1)  # Anthropic's range
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=INT64_MAX)
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # its format (a JSON schema) is acted on; effort is not
    service_tier: str | None = None  # accepted, not acted on

    @field_validator("stop_sequences")
    @classmethod
    def _no_empty_stop(cls, value: list[str] | None) -> list[str] | None:
        if value and "" in value:
            raise ValueError("stop sequences must not be empty")
        return value

    def chat_fields(self) -> dict[str, Any]:
        fields = super().chat_fields()
        user = (self.metadata or {}).get("user_id")
        sampling = {"max_tokens": self.max_tokens, "stop": self.stop_sequences or None,
                    "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                    "user": user if isinstance(user, str) else None,
                    "response_format": response_format(self.output_config)}
        extras = {k: v for k, v in (self.model_extra or {}).items() if k in CHAT_EXTRAS}
        return {**fields, **{k: v for k, v in sampling.items() if v is not None}, **extras}


def _block_kind(block: Any, where: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise ValueError(f"{where} must be a content block with a type")
    if kind == "text" and not isinstance(block.get("text"), str):
        raise ValueError(f"{where}.text must be a string")
    return kind


def _text(content: Any, where: str) -> str:
    """A string, or text blocks joined by newlines (as chat joins text parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of text blocks")
    texts = []
    for j, block in enumerate(content):
        kind = _block_kind(block, f"{where}[{j}]")
        if kind != "text":
            raise ValueError(f"{where}[{j}]: only text blocks are supported here, got {kind!r}")
        texts.append(block["text"])
    return "\n".join(texts)


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str):
        url = f"data:{source['media_type']};base64,{source['data']}"
    elif kind == "url" and isinstance(source.get("url"), str) and source["url"]:
        url = source["url"]
    else:
        raise ValueError(f"{where}.source must be {{'type': 'base64', 'media_type': ..., 'data': ...}} or "
                         f"{{'type': 'url', 'url': ...}} (got type {kind!r})")
    return {"type": "image_url", "image_url": {"url": url}, "source_param": f"{where}.source"}


def _user_turns(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """A user turn: a tool turn per tool_result block, then its text and images (if any)."""
    tools: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = _block_kind(block, at)
        if kind == "text":
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append(_image_part(block, at))
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise ValueError(f"{at}.tool_use_id must be a non-empty string")
            tools.append({"role": "tool", "tool_call_id": call_id, "content": _text(block.get("content", ""),
                                                                                   f"{at}.content")})
        else:
            raise ValueError(f"{at}: a user turn takes text, image and tool_result blocks, got {kind!r}")
    return tools + ([{"role": "user", "content": parts}] if parts or not tools else [])


def _assistant_turn(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = _block_kind(block, at)
        if kind == "text":
            texts.append(block["text"])
        elif kind == "tool_use":
            calls.append(_call(block, at))
        elif kind not in _SKIPPED_BLOCKS:
            raise ValueError(f"{at}: an assistant turn takes text, tool_use and thinking blocks, got {kind!r}")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _call(block: dict[str, Any], where: str) -> dict[str, Any]:
    for key in ("id", "name"):
        if not isinstance(block.get(key), str) or not block[key]:
            raise ValueError(f"{where}.{key} must be a non-empty string")
    if not isinstance(block.get("input"), dict):
        raise ValueError(f"{where}.input must be an object")
    arguments = json.dumps(block["input"], ensure_ascii=False)
    return {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Anthropic's client tools in chat's shape {"type": "function", "function": {...}}."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise ValueError(f"tools[{i}]: tools of type {kind!r} are not supported (server tools run on "
                             "Anthropic's side; declare a client tool with name and input_schema)")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise ValueError(f"tools[{i}].name must be a non-empty string")
        if not isinstance(tool.get("input_schema"), dict):
            raise ValueError(f"tools[{i}].input_schema must be a JSON schema object")
        # OpenAI's order of keys (a template that writes tools as JSON shows them in it).
        function = {"name": tool["name"], **({"description": tool["description"]} if "description" in tool else {}),
                    "parameters": tool["input_schema"], **({"strict": tool["strict"]} if "strict" in tool else {})}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> dict[str, Any]:
    """tool_choice and parallel_tool_calls of the chat request."""
    if choice is None:
        return {}
    kind = choice.get("type")
    fields: dict[str, Any] = {"parallel_tool_calls": False} if choice.get("disable_parallel_tool_use") else {}
    if kind in ("auto", "none"):
        return {**fields, "tool_choice": kind}
    if kind == "any":
        return {**fields, "tool_choice": "required"}
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {**fields, "tool_choice": {"type": "function", "function": {"name": choice["name"]}}}
    raise ValueError("tool_choice must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}")


def response_format(output_config: dict[str, Any] | None) -> dict[str, Any] | None:
    """output_config.format ({"type": "json_schema", "schema": ...}) as chat's response_format."""
    fmt = (output_config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ValueError("output_config.format must be {'type': 'json_schema', 'schema': {...}}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
