"""The structured-output grammar checks that need no tokenizer and no torch: a spec's grammar
as EBNF, and whether it parses. The router runs check_spec so a malformed schema or regex is a
400; the engine compiles the same grammars against its vocabulary (engine.structured_output)."""
from __future__ import annotations

import json

from pdserve.protocol.sampling_params import StructuredSpec

# A request whose grammar no drawable token can continue ends with this finish reason (and the
# router says why), never as a plain "stop" that looks like success.
DEAD_END_FINISH = "grammar_dead_end"
DEAD_END_MESSAGE = ("the structured-output constraint could not be continued: no token of this model's "
                    "vocabulary that the other sampling settings allow fits the grammar here")

# Tool-call markers a chat template may write as special tokens (Mistral's [TOOL_CALLS]; some
# Hermes fine-tunes' <tool_call>). A tool-call structural tag is compiled with these kept in the
# vocabulary as their text, so its trigger can open on the token (engine.structured_output);
# every other grammar leaves all special tokens out.
TOOL_CALL_MARKERS = ("[TOOL_CALLS]", "<tool_call>", "</tool_call>")

# Compact JSON (no free whitespace): a grammar that allows any whitespace lets a weak model
# pad forever instead of closing the object.
ANY_WHITESPACE = False
# xgrammar writes the characters of a length-bounded string (minLength/maxLength) as the first
# class below, which lets raw control characters into the string; strict JSON parsers
# (pydantic, json.loads(strict=True)) refuse them. Its other strings exclude \0-\x1f. Both
# classes also match UTF-16 surrogates spelled as UTF-8 bytes, which no decoder accepts (each
# byte becomes U+FFFD, and a bounded string comes out longer than its maxLength).
_STRING_CHAR_CLASSES = {
    r'[^\"\\\r\n]': r'[^\0-\x1f\"\\\uD800-\uDFFF]',
    r'[^\0-\x1f\"\\\r\n]': r'[^\0-\x1f\"\\\uD800-\uDFFF]',
}


def strict_json_grammar(schema: str) -> str:
    """The schema's grammar as EBNF, with every string character class held to strict JSON."""
    import xgrammar as xgr  # deferred: xgrammar loads torch, and the router imports this module
    return _strict_strings(str(xgr.Grammar.from_json_schema(schema, any_whitespace=ANY_WHITESPACE)))


def structural_tag_grammar(spec: str) -> str:
    """A structural tag's grammar (free text, then tagged JSON) as EBNF, its JSON strings held
    to strict JSON as strict_json_grammar's are."""
    import xgrammar as xgr  # deferred: xgrammar loads torch, and the router imports this module
    return _strict_strings(str(xgr.Grammar.from_structural_tag(spec)))


def _strict_strings(ebnf: str) -> str:
    for lax, strict in _STRING_CHAR_CLASSES.items():
        ebnf = ebnf.replace(lax, strict)
    return ebnf


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of the strings (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def check_spec(spec: StructuredSpec) -> None:
    """Raise ValueError when the spec does not parse (no tokenizer needed: the router calls
    this so a malformed schema or regex is a 400, not a node error)."""
    import xgrammar as xgr  # deferred: xgrammar loads torch, and the router imports this module
    try:
        if spec.kind == "json":
            xgr.Grammar.from_json_schema(spec.spec, any_whitespace=ANY_WHITESPACE)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.spec)
        elif spec.kind == "choice":
            xgr.Grammar.from_ebnf(choice_grammar(parse_choices(spec.spec)))
        elif spec.kind == "structural_tag":
            xgr.Grammar.from_ebnf(structural_tag_grammar(spec.spec))
        else:
            xgr.Grammar.from_ebnf(spec.spec)
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's parse errors are RuntimeErrors
        raise ValueError(f"invalid {spec.kind} for structured output: {error_first_line(exc)}") from None


def parse_choices(spec: str) -> list[str]:
    choices = json.loads(spec)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("a choice must be a non-empty list of non-empty strings")
    return choices


def error_first_line(exc: Exception) -> str:
    # xgrammar prefixes "[time] /path/file.cc:line: "; keep only the message.
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text
