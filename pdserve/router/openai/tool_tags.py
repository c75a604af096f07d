"""Tool calls valid by construction under tool_choice "auto": an xgrammar structural tag.

The output stays free text until the model writes its template's tool-call marker (the
trigger: Hermes `<tool_call>`, Llama 3's `{"name": "`, Mistral's `[TOOL_CALLS]`). From there the
grammar holds it to a call of a declared tool: the name is one of theirs, the arguments match
that tool's `parameters` schema (exactly under `strict: true`; a tool without it falls back to
any JSON object when xgrammar cannot build its schema, the other tools keeping theirs). With
parallel_tool_calls (OpenAI's default) more calls may follow, joined as the family's parser
reads them (Hermes: one block after another; Llama 3: "; "; Mistral: the array's ", "), each
held the same way, up to MAX_PARALLEL_CALLS; with parallel_tool_calls false, one. After the last
call's closing marker only the stop token is allowed (stop_after_first), so the calls end the
turn: no text after them (the model may not go on with an answer it has not the results for).
Before the trigger every token the model may draw stays allowed, so greedy text without a call
equals the same request without tools. Built here as plain JSON (no torch); the nodes compile it
(structured_output).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdserve.protocol.grammar import TOOL_CALL_MARKERS
from pdserve.protocol.sampling_params import StructuredSpec

# One whitespace at most between JSON tokens: a weak model allowed any pads forever instead of
# closing the object, and one space keeps the `{"city": "Paris"}` spacing the templates show.
MAX_WHITESPACE = 1
# Calls in one turn: a small model that copies its own call again and again stops here, with its
# calls whole (unbounded, it repeats until max_tokens cuts the last one off).
MAX_PARALLEL_CALLS = 8
_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class CallFormat:
    """How a family writes a call: trigger, then begin, prefix, the arguments, suffix, end."""
    trigger: str
    begin: str
    prefix: str  # "{name}" stands for the JSON-escaped function name
    suffix: str
    end: str
    separator: str  # between two calls of one turn, as the family's parser reads them


FORMATS = {
    # <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>, as SmolLM2's and Qwen's templates show;
    # several calls are consecutive blocks
    "hermes": CallFormat("<tool_call>", "<tool_call>\n", '{{"name": "{name}", "arguments": ', "}", "\n</tool_call>",
                         "\n</tool_call>\n<tool_call>\n"),
    # {"name": "f", "parameters": {...}} (the closing brace is the end: xgrammar wants a
    # non-empty end after unbounded content); several calls are joined by "; "
    "llama3_json": CallFormat('{"name": "', '{"name": "', '{name}", "parameters": ', "", "}", '}; {"name": "'),
    # [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]
    "mistral": CallFormat("[TOOL_CALLS]", "[TOOL_CALLS][", '{{"name": "{name}", "arguments": ', "}", "]", ", "),
}


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def _call(fmt: CallFormat, name: str, schema: dict | bool) -> dict[str, Any]:
    escaped = json.dumps(name, ensure_ascii=False)[1:-1]
    arguments = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}
    return {"type": "sequence", "elements": [_const(fmt.prefix.format(name=escaped)), arguments, _const(fmt.suffix)]}


def _strict(tool: dict[str, Any]) -> bool:
    return tool["function"].get("strict") is True


def tool_call_tag(fmt: CallFormat, tools: list[tuple[str, Any]], max_calls: int = 1) -> str:
    """The structural tag (JSON text) for these (name, parameters schema) pairs: one call, or up
    to max_calls of them, each held to a declared tool, in one run of the family's separators."""
    call = {"type": "or", "elements": [_call(fmt, name, schema) for name, schema in tools]}
    more = {"type": "sequence", "elements": [_const(fmt.separator), call]}
    calls = call if max_calls == 1 else {"type": "sequence", "elements": [
        call, {"type": "repeat", "min": 0, "max": max_calls - 1, "content": more}]}
    tag = {"type": "tag", "begin": fmt.begin, "content": calls, "end": fmt.end}
    triggered = {"type": "triggered_tags", "triggers": [fmt.trigger], "tags": [tag], "stop_after_first": True}
    return json.dumps({"type": "structural_tag", "format": triggered}, ensure_ascii=False)


def tool_call_spec(plan: Any, parser_name: str, special_tokens: set[str], check: Any) -> StructuredSpec | None:
    """The constraint for a ToolPlan in mode "auto" written in this parser's format; None when
    the format is unknown, or its markers hold a special token other than TOOL_CALL_MARKERS (the
    grammar's vocabulary leaves those out, so the call could never open or close: such calls stay
    parsed from free text). A marker that is one of TOOL_CALL_MARKERS (Mistral's [TOOL_CALLS]) the
    nodes compile into the tag's vocabulary (structured_output.tag_compiler).
    check: structured_request's cached check (ValueError when xgrammar cannot build it)."""
    fmt = FORMATS.get(parser_name)
    markers = fmt.begin + fmt.end + fmt.separator if fmt is not None else ""
    if plan.mode != "auto" or fmt is None or any(
            s and s in markers and s not in TOOL_CALL_MARKERS for s in special_tokens):
        return None
    tools = [(t["function"]["name"], json.loads(plan.parameters(t["function"]["name"]))) for t in plan.tools]
    max_calls = MAX_PARALLEL_CALLS if plan.parallel else 1
    try:
        return check("structural_tag", tool_call_tag(fmt, tools, max_calls))
    except ValueError:
        if all(_strict(t) for t in plan.tools):
            raise
    # A schema xgrammar cannot build: that tool, unless `strict`, gets a well-formed JSON object;
    # the others keep their schemas.
    loose = [(name, schema if _strict(t) or _builds(check, schema) else _ANY_OBJECT)
             for (name, schema), t in zip(tools, plan.tools)]
    return check("structural_tag", tool_call_tag(fmt, loose, max_calls))


def _builds(check: Any, schema: Any) -> bool:
    try:
        check("json", json.dumps(schema, ensure_ascii=False))
    except ValueError:
        return False
    return True
