"""The request fields that ask for structured output, reduced to one StructuredSpec.

Accepted spellings: OpenAI's `response_format` (json_object, json_schema) and named
`tool_choice` with `tools`; vLLM's `structured_outputs` ({json|regex|choice|grammar}) and its
older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. At most one may be
given. The spec is parsed here (check_spec, cached) so a malformed schema or regex is a 400 at
the router, never a node error.
"""
from __future__ import annotations

import functools
import json
from typing import Any

from pdserve.engine.sampling_params import StructuredSpec
from pdserve.engine.structured_output import check_spec

# json_object: any JSON object (compact, see structured_output.ANY_WHITESPACE).
JSON_OBJECT_SCHEMA = '{"type": "object"}'
_VLLM_KEYS = ("json", "regex", "choice", "grammar")


@functools.lru_cache(maxsize=1024)
def _checked(kind: str, spec: str) -> StructuredSpec:
    value = StructuredSpec(kind, spec)
    check_spec(value)
    return value


def _schema_text(schema: Any, where: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"{where} is not valid JSON: {exc}") from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON schema object")
    # Key order is kept: xgrammar emits properties in the order the schema lists them.
    return json.dumps(schema, ensure_ascii=False)


def _from_response_format(fmt: Any) -> tuple[str, str] | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ValueError("response_format.type must be 'text', 'json_object' or 'json_schema'")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return "json", JSON_OBJECT_SCHEMA
    inner = fmt.get("json_schema")
    if not isinstance(inner, dict) or "schema" not in inner:
        raise ValueError("response_format.json_schema.schema is required for type 'json_schema'")
    return "json", _schema_text(inner["schema"], "response_format.json_schema.schema")


def _from_vllm(structured: Any, guided: dict[str, Any]) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    sources = [(k, v) for k, v in (structured or {}).items() if v is not None and k in _VLLM_KEYS]
    sources += [(k, v) for k, v in guided.items() if v is not None]
    for kind, value in sources:
        if kind == "json":
            found.append(("json", _schema_text(value, "the json schema")))
        elif kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            found.append(("choice", json.dumps(value, ensure_ascii=False)))
        elif not isinstance(value, str) or not value:
            raise ValueError(f"{kind} must be a non-empty string")
        else:
            found.append((kind, value))
    return found


def named_tool(tools: list[dict] | None, tool_choice: Any) -> tuple[str, str] | None:
    """(name, parameters schema text) of the tool that tool_choice names; None for 'none' or
    absent (tools are then ignored). 'auto' and 'required' are not supported: ValueError."""
    if tool_choice is None or tool_choice == "none":
        return None
    if isinstance(tool_choice, str):
        raise ValueError(f"tool_choice {tool_choice!r} is not supported; name a function "
                         "({'type': 'function', 'function': {'name': ...}}) or send 'none'")
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError("tool_choice must name a function: {'type': 'function', 'function': {'name': ...}}")
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            schema = function.get("parameters", {"type": "object", "properties": {}})
            return name, _schema_text(schema, f"the parameters of tool {name!r}")
    raise ValueError(f"tool_choice names {name!r}, which is not among the tools")


def structured_spec(response_format: Any, structured: Any, guided: dict[str, Any],
                    tool: tuple[str, str] | None = None) -> StructuredSpec | None:
    """The one constraint the request asks for (ValueError when several or malformed)."""
    found = _from_vllm(structured, guided)
    from_format = _from_response_format(response_format)
    found += [from_format] if from_format else []
    found += [("json", tool[1])] if tool else []
    if len(found) > 1:
        raise ValueError("ask for one structured output at a time (response_format, structured_outputs, "
                         "guided_*, or a named tool_choice)")
    return _checked(*found[0]) if found else None
