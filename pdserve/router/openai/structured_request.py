"""The request fields that ask for structured output, reduced to one StructuredSpec.

Accepted spellings: OpenAI's `response_format` (json_object, json_schema) and
`tool_choice` "required" or a named function with `tools`; vLLM's `structured_outputs` ({json|regex|choice|grammar}) and its
older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. At most one may be
given. The spec is parsed here (check_spec, cached) so a malformed schema or regex is a 400 at
the router, never a node error. Every tool's `parameters` is checked against the JSON Schema
meta-schema under any tool_choice, so an invalid one is a 400 even where no grammar is built.
"""
from __future__ import annotations

import functools
import json
import threading
from dataclasses import dataclass, field
from typing import Any

import anyio
import jsonschema

from pdserve.protocol.grammar import check_spec
from pdserve.protocol.sampling_params import StructuredSpec
from pdserve.router.openai.tool_schemas import ToolsError, empty_enum_at, hoist_defs

# json_object: any JSON object (compact, see structured_output.ANY_WHITESPACE).
JSON_OBJECT_SCHEMA = '{"type": "object"}'
_VLLM_KEYS = ("json", "regex", "choice", "grammar")
_JSON_TYPES = {str: "a string", list: "an array", bool: "a boolean", int: "a number", float: "a number"}


@functools.lru_cache(maxsize=1024)
def checked_spec(kind: str, spec: str) -> StructuredSpec:
    """The spec, parsed once (ValueError when xgrammar cannot build it)."""
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


@dataclass
class ToolPlan:
    """What tool_choice asks for. mode: "none" (tools not shown to the model), "auto" (the
    model answers in text or calls tools; calls are parsed out of the text, and a call the model
    opens is held to the tools by a structural tag, tool_tags.py), "required" (the
    output is constrained to a JSON list of calls) or "named" (to that function's arguments)."""
    mode: str
    tools: list[dict[str, Any]] = field(default_factory=list)  # the function tools, checked
    name: str | None = None  # mode "named": the function
    parallel: bool = True  # parallel_tool_calls: false allows one call ("required": the grammar's array)

    def parameters(self, name: str) -> str:
        function = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        schema = function.get("parameters") or {"type": "object", "properties": {}}
        return _schema_text(schema, f"the parameters of tool {name!r}")

    def grammar(self) -> tuple[str, str] | None:
        """The structured-output constraint this plan puts on the output."""
        if self.mode == "named":
            return "json", self.parameters(self.name)
        if self.mode != "required":
            return None
        defs: dict[str, Any] = {}
        calls = [{"type": "object", "properties": {
                      "name": {"const": t["function"]["name"]},
                      "parameters": hoist_defs(json.loads(self.parameters(t["function"]["name"])), f"tool{i}", defs)},
                  "required": ["name", "parameters"]} for i, t in enumerate(self.tools)]
        array = {"type": "array", "minItems": 1, **({} if self.parallel else {"maxItems": 1}), "items": {"anyOf": calls}}
        if defs:
            array["$defs"] = defs
        return "json", json.dumps(array, ensure_ascii=False)

    def grammar_error(self, exc: ValueError) -> ToolsError:
        """Why the grammar() of these tools cannot be built, naming the first tool whose own
        parameters cannot be (else the combination)."""
        for i, tool in enumerate(self.tools):
            name = tool["function"]["name"]
            if self.mode == "named" and name != self.name:
                continue
            try:
                checked_spec("json", self.parameters(name))
            except ValueError as own:
                return ToolsError(f"tools[{i}] ({name!r}): its parameters cannot be built into a grammar: {own}")
        return ToolsError(f"the tools' parameters cannot be built into one grammar: {exc}")


@functools.lru_cache(maxsize=1024)
def _check_schema_text(text: str) -> None:
    # Cached by the schema's text: an agent sends the same tools with every turn.
    schema = json.loads(text)
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator.check_schema(schema)


def _check_parameters(parameters: Any, where: str) -> None:
    """ToolsError unless `parameters` is absent or a JSON schema object (as OpenAI: a string
    holding one is refused too)."""
    if parameters is None:
        return
    if not isinstance(parameters, dict):
        kind = _JSON_TYPES.get(type(parameters), type(parameters).__name__)
        raise ToolsError(f"{where}: parameters must be a JSON schema object, got {kind}")
    try:
        _check_schema_text(json.dumps(parameters, sort_keys=True, ensure_ascii=False))
    except jsonschema.SchemaError as exc:
        raise ToolsError(f"{where}: parameters is not a valid JSON schema: {exc.message} (at {exc.json_path})") from None
    except RecursionError:  # nesting deeper than the interpreter's stack: not a schema anyone means
        raise ToolsError(f"{where}: parameters is nested too deeply") from None
    empty = empty_enum_at(parameters)
    if empty is not None:  # valid JSON Schema, but no value matches it (and templates choke on it)
        raise ToolsError(f"{where}: parameters has an empty enum at {empty}: no value can match it")


def _function_tools(tools: list[dict] | None) -> list[dict[str, Any]]:
    checked = []
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ToolsError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                             "'parameters': {...}}}")
        _check_parameters(function.get("parameters"), f"tools[{i}]")
        checked.append(tool)
    return checked


def tool_plan(tools: list[dict] | None, tool_choice: Any, parallel: bool = True) -> ToolPlan | None:
    """The plan for these tools and tool_choice; None without tools. As OpenAI: tool_choice
    defaults to "auto" when tools are given. parallel: parallel_tool_calls (false: one call at
    most). ValueError when malformed."""
    checked = _function_tools(tools)
    if tool_choice is None:
        tool_choice = "auto" if checked else "none"
    if tool_choice == "none":
        return None
    if tool_choice in ("auto", "required"):
        if not checked:
            raise ValueError(f"tool_choice {tool_choice!r} needs tools")
        return ToolPlan(tool_choice, checked, parallel=parallel)
    if isinstance(tool_choice, str):
        raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or name a function, got {tool_choice!r}")
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError("tool_choice must name a function: {'type': 'function', 'function': {'name': ...}}")
    if not any(t["function"]["name"] == name for t in checked):
        raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    return ToolPlan("named", checked, name)


def structured_spec(response_format: Any, structured: Any, guided: dict[str, Any],
                    tools: ToolPlan | None = None) -> StructuredSpec | None:
    """The one constraint the request asks for (ValueError when several or malformed)."""
    found = _from_vllm(structured, guided)
    from_format = _from_response_format(response_format)
    found += [from_format] if from_format else []
    from_tools = tools.grammar() if tools is not None else None
    found += [from_tools] if from_tools else []
    if len(found) > 1:
        raise ValueError("ask for one structured output at a time (response_format, structured_outputs, "
                         "guided_*, or tool_choice 'required' or named)")
    if not found:
        return None
    try:
        return checked_spec(*found[0])
    except ValueError as exc:
        if tools is None or found[0] is not from_tools:
            raise
        raise tools.grammar_error(exc) from None


class GrammarCheck:
    """Whether a constraint can be met with the model's vocabulary, checked at the router with
    its tokenizer (each spec compiled once, in a worker thread) so an impossible one is a 400
    before any node generates, not an empty answer with finish_reason "stop"."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._lock = threading.Lock()  # one bitmask buffer
        self._outputs: Any = None  # engine.structured_output.StructuredOutputs, built at the first check
        self._satisfiable: set[tuple[str, str]] = set()

    async def check(self, spec: StructuredSpec) -> None:
        """ValueError when no output the constraint accepts can be written in this vocabulary."""
        key = (spec.kind, spec.spec)
        if key not in self._satisfiable:
            await anyio.to_thread.run_sync(self._check, spec)
            if len(self._satisfiable) > 4096:
                self._satisfiable.clear()
            self._satisfiable.add(key)

    def _check(self, spec: StructuredSpec) -> None:
        with self._lock:
            if self._outputs is None:
                # Heavy: torch and xgrammar, loaded at the first constrained request, never at import.
                from pdserve.engine.structured_output import StructuredOutputs
                eos = getattr(self.tokenizer, "eos_token_id", None)
                self._outputs = StructuredOutputs(self.tokenizer, len(self.tokenizer), {eos} if eos is not None else set())
            self._outputs.check_satisfiable(spec)
