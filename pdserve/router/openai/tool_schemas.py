"""Tool schemas as the grammars take them: each tool's definitions hoisted into a schema of
several tools (tool_choice "required"), and the checks of `parameters` beyond the JSON Schema
meta-schema. Their errors are ToolsError, whose 400 names `tools`."""
from __future__ import annotations

from typing import Any


class ToolsError(ValueError):
    """A malformed entry of `tools` (its 400 names `tools`, not `tool_choice`)."""
    param = "tools"


def empty_enum_at(schema: Any) -> str | None:
    """The JSON path of the first `enum: []` in the schema (None without one). Iterative: a
    schema may nest deeper than the recursion limit left at this point."""
    stack: list[tuple[str, Any]] = [("$", schema)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            if node.get("enum") == []:
                return f"{path}.enum"
            stack.extend((f"{path}.{k}", v) for k, v in node.items() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(node) if isinstance(v, (dict, list)))
    return None


_DEF_KEYS = ("$defs", "definitions")


def _pointer_segment(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _moved_ref(ref: str, prefix: str) -> str:
    """A ref of the tool's schema, as it reads once the schema's definitions are under the
    combined schema's $defs as prefix.NAME, and the schema's root (a recursive "#") as prefix."""
    for key in _DEF_KEYS:
        head = f"#/{key}/"
        if ref.startswith(head):
            segment, slash, tail = ref[len(head):].partition("/")
            return f"#/$defs/{_pointer_segment(prefix + '.')}{segment}{slash}{tail}"
    if ref == "#" or ref.startswith("#/"):
        return f"#/$defs/{_pointer_segment(prefix)}{ref[1:]}"
    return ref  # a URL or an $id's anchor: not this schema's to move


def _rewrite_refs(value: Any, prefix: str) -> Any:
    if isinstance(value, dict):
        return {k: (_moved_ref(v, prefix) if k == "$ref" and isinstance(v, str) else _rewrite_refs(v, prefix))
                for k, v in value.items()}
    if isinstance(value, list):
        return [_rewrite_refs(v, prefix) for v in value]
    return value


def _refers_to_root(value: Any) -> bool:
    if isinstance(value, dict):
        ref = value.get("$ref")
        if isinstance(ref, str) and (ref == "#" or (ref.startswith("#/") and not ref.startswith(("#/$defs/",
                                                                                               "#/definitions/")))):
            return True
        return any(_refers_to_root(v) for v in value.values())
    return isinstance(value, list) and any(_refers_to_root(v) for v in value)


def hoist_defs(schema: Any, prefix: str, defs: dict[str, Any]) -> Any:
    """A tool's parameters, to be nested in a schema of several tools (tool_choice "required"):
    its `$defs`/`definitions` (what pydantic writes for nested models) move into `defs`, the
    combined schema's $defs, as prefix.NAME, so no two tools' names clash, and its refs are
    rewritten to match. A schema that refers to its own root (recursive through "#") moves whole
    into `defs` as prefix and is referred to from where it stood."""
    if not isinstance(schema, dict):
        return schema
    root_refs = _refers_to_root(schema)
    body = _rewrite_refs({k: v for k, v in schema.items() if k not in _DEF_KEYS}, prefix)
    for key in _DEF_KEYS:
        for name, definition in (schema.get(key) or {}).items():
            defs[f"{prefix}.{name}"] = _rewrite_refs(definition, prefix)
    if not root_refs:
        return body
    defs[prefix] = body
    return {"$ref": f"#/$defs/{_pointer_segment(prefix)}"}
