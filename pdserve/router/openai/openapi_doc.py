"""The router's OpenAPI document, completed with what only the running app knows (the model's
vocabulary and embedding size) and with integer bounds kept exact, so that its constraints are
the ones the server enforces: a client generated from it, or a fuzzer (tests/test_openapi_fuzz.py),
sends no request that a check the document does not mention refuses."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI

from pdserve.router.openai.errors import drop_validation_422
from pdserve.router.openai.schemas import INT64_MAX, INT64_MIN

# Where token ids are taken, each checked against the vocabulary: (schema, property).
_TOKEN_IDS = [("CompletionRequest", "prompt"), ("EmbeddingRequest", "input"), ("DetokenizeRequest", "tokens")]
_LOGIT_BIAS = ["CompletionRequest", "ChatCompletionRequest"]


def openapi_document(app: FastAPI, vocab_size: int, embedding_size: int | None) -> dict[str, Any]:
    """embedding_size: the only `dimensions` /v1/embeddings takes (None: it takes none)."""
    doc = drop_validation_422(FastAPI.openapi(app))  # cached by FastAPI; the edits are idempotent
    schemas = doc["components"]["schemas"]
    _exact_integer_bounds(doc)
    for name, prop in _TOKEN_IDS:
        for node in _nodes(schemas[name]["properties"][prop]):
            if node.get("type") == "integer":
                node.update(minimum=0, maximum=vocab_size - 1)
    for name in _LOGIT_BIAS:
        for node in _nodes(schemas[name]["properties"]["logit_bias"]):
            if node.get("type") == "object":
                node["propertyNames"] = {"pattern": decimal_below(vocab_size)}
    sizes = [{"type": "integer", "enum": [embedding_size]}] if embedding_size else []
    schemas["EmbeddingRequest"]["properties"]["dimensions"] = {
        "anyOf": [*sizes, {"type": "null"}], "title": "Dimensions",
        "description": "Only the model's own embedding size: its vectors are not trained to be truncated."}
    return doc


def _nodes(schema: Any) -> Iterator[dict[str, Any]]:
    """Every schema object under `schema` (itself included)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            yield node
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _exact_integer_bounds(doc: dict[str, Any]) -> None:
    # FastAPI's document model holds bounds as floats: 2**63 - 1 becomes 2**63, a value the
    # int64 fields refuse. An integer's bounds go back to ints, clamped to int64.
    for node in _nodes(doc):
        if node.get("type") != "integer":
            continue
        for key in ("minimum", "maximum"):
            value = node.get(key)
            if isinstance(value, float):
                node[key] = min(max(int(value), INT64_MIN), INT64_MAX)


def decimal_below(n: int) -> str:
    """A regex for the decimal integers 0 .. n-1 (n >= 1), without leading zeros."""
    top = str(n - 1)
    if len(top) == 1:
        return f"^[0-{top}]$"
    shorter = f"0|[1-9][0-9]{{0,{len(top) - 2}}}"
    options = [shorter]
    for i, digit in enumerate(map(int, top)):
        low = 1 if i == 0 else 0
        if digit > low:  # top's first i digits, a smaller digit here, then any digits
            rest = len(top) - i - 1
            options.append(f"{top[:i]}[{low}-{digit - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    options.append(top)
    return f"^({'|'.join(options)})$"
