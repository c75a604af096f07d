"""POST /v1/responses' body, and what it becomes: the messages and fields of a chat request.

The Responses API is served by the chat-completions path (chat template, structured outputs,
tool calls, the P/D backend), so its request is translated here:
  * `input`: a string (one user turn), or a list of items: messages (`role`, `content` as a
    string or `input_text`/`output_text` parts, and `input_image` parts, which become chat
    `image_url` parts; role `developer` is the system turn),
    `function_call` items (an assistant turn that called a tool) and `function_call_output`
    items (the tool's answer);
  * `instructions`: a system turn first (not carried over to a follow-up, as in OpenAI's API);
  * `tools` in Responses' flat shape `{"type": "function", "name", "parameters"}`, `tool_choice`
    `"auto" | "none" | "required" | {"type": "function", "name"}`;
  * `text.format` (`text`, `json_object`, `json_schema`) as `response_format`;
  * `max_output_tokens`, `temperature`, `top_p`, `user`, and vLLM's `cache_salt`.
Unknown fields are a 400 (extra="forbid"): a client that asks for something this server does
not do learns it, rather than getting an answer that silently ignored it. A few fields that
change nothing here are accepted and ignored (see IGNORED_FIELDS).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, WithJsonSchema, field_validator

from pdserve.router.openai.schemas import INT64_MAX, CacheSalt, UnicodeCheckedRequest

# Accepted and ignored: routing and billing hints, and what only changes OpenAI's own service.
IGNORED_FIELDS = ("metadata", "parallel_tool_calls", "prompt_cache_key", "safety_identifier", "service_tier",
                  "stream_options", "truncation")
_TEXT_PART_TYPES = ("input_text", "output_text", "text")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


# What input_items_to_messages takes, for the document: objects; a message (the default type) has a role.
_INPUT_ITEM = {"anyOf": [
    {"type": "object", "required": ["role"],
     "properties": {"type": {"const": "message"}, "role": {"enum": sorted(_ROLES)}}},
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["function_call", "function_call_output"]}}}]}


class ResponsesRequest(UnicodeCheckedRequest):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = None
    # Items are checked in input_items_to_messages, with clearer messages; emptiness in _some_input.
    input: Annotated[str | list[Any], WithJsonSchema(
        {"anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "items": _INPUT_ITEM, "minItems": 1}],
         "description": "A string (one user turn) or a list of input items; not empty."})]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    stream: bool | None = False
    max_output_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    user: str | None = None
    cache_salt: CacheSalt = None  # vLLM's, as on the chat and completions routes
    # Accepted, not acted on (IGNORED_FIELDS); metadata is echoed back as OpenAI does.
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    # Accepted only at values that ask for nothing this server lacks.
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=0)

    @field_validator("include")
    @classmethod
    def _no_includes(cls, value: list[str] | None) -> list[str] | None:
        if value:
            raise ValueError(f"include is not supported (got {value}): no reasoning, logprobs or tool outputs "
                             "to add")
        return value

    @field_validator("reasoning")
    @classmethod
    def _no_reasoning(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # A reasoning block asking for nothing ({} or effort null/"none") is what some clients always send.
        if value and any(v not in (None, "none") for v in value.values()):
            raise ValueError("reasoning is not supported: the served model does not reason")
        return value

    @field_validator("background")
    @classmethod
    def _not_background(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("background responses are not supported")
        return value

    @field_validator("input")
    @classmethod
    def _some_input(cls, value: str | list[Any]) -> str | list[Any]:
        if not value:  # "" as much as []: there is no turn to answer
            raise ValueError("input must not be empty")
        return value

    def input_messages(self) -> list[dict[str, Any]]:
        """This request's input as chat messages (ValueError when an item is malformed)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return input_items_to_messages(self.input)

    def chat_fields(self) -> dict[str, Any]:
        """The chat request's fields other than messages (ValueError when malformed)."""
        fields = {"model": self.model, "max_completion_tokens": self.max_output_tokens,
                  "temperature": self.temperature, "top_p": self.top_p, "user": self.user,
                  "tools": chat_tools(self.tools), "tool_choice": chat_tool_choice(self.tool_choice),
                  "response_format": response_format(self.text)}
        return {k: v for k, v in fields.items() if v is not None}


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of text parts")
    return "\n".join(_part_text(part, f"{where}[{j}]") for j, part in enumerate(content))  # as chat joins them


def _part_text(part: Any, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in _TEXT_PART_TYPES or not isinstance(part.get("text"), str):
        raise ValueError(f"{where}: only text parts ({', '.join(_TEXT_PART_TYPES)}) and, in a message, "
                         f"input_image parts are supported, got {kind!r}")
    return part["text"]


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content for the chat request: its text, or, when it has input_image parts,
    chat content parts (text and image_url, each image naming its own field for errors)."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                for p in content):
        return _text(content, where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            parts.append(_image_part(part, f"{where}[{j}]"))
        else:
            parts.append({"type": "text", "text": _part_text(part, f"{where}[{j}]")})
    return parts


def _image_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    url = part.get("image_url")
    if part.get("file_id") is not None and url is None:
        raise ValueError(f"{where}.file_id: images by file id are not supported (send image_url: a data: URL, "
                         "or an http(s) URL the server allows)")
    if not isinstance(url, str) or not url:
        raise ValueError(f"{where}.image_url must be a non-empty string (a data: or http(s) URL)")
    detail = part.get("detail")
    if detail not in (None, "auto", "low", "high"):
        raise ValueError(f"{where}.detail must be 'auto', 'low' or 'high', got {detail!r}")
    return {"type": "image_url", "image_url": {"url": url, "detail": detail}, "source_param": f"{where}.image_url"}


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise ValueError(f"{where}.{key} must be a non-empty string")
    return value


def _add_call(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    """A function_call item joins the assistant turn it follows, or starts one."""
    call = {"id": _string(item, "call_id", where), "type": "function",
            "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def input_items_to_messages(items: list[Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            # Not a string (an object is unhashable): no role, the same 400.
            role = _ROLES.get(item["role"]) if isinstance(item.get("role"), str) else None
            if role is None:
                raise ValueError(f"{where}.role must be one of {sorted(_ROLES)}, got {item.get('role')!r}")
            messages.append({"role": role, "content": _content(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            _add_call(messages, item, where)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": _text(item.get("output"), f"{where}.output")})
        else:
            raise ValueError(f"{where}: input items of type {kind!r} are not supported (message, function_call, "
                             "function_call_output)")
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools in the chat shape {"type": "function", "function": {...}}."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise ValueError(f"tools[{i}]: tools of type {tool.get('type')!r} are not supported (only 'function')")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].name must be a non-empty string")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice  # "auto", "none", "required"; the chat path refuses the rest
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise ValueError("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}")
    return {"type": "function", "function": {"name": choice["name"]}}


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format as chat's response_format; text.verbosity is a hint, not acted on."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ValueError("text.format.type must be 'text', 'json_object' or 'json_schema'")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    if "schema" not in fmt:
        raise ValueError("text.format.schema is required for type 'json_schema'")
    inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": inner}
