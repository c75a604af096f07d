"""Which tokenizer class transformers' AutoTokenizer loads for a checkpoint whose
tokenizer_config.json names the generic fast tokenizer, found without importing torch.

AutoTokenizer resolves such a checkpoint by its config.json's `model_type`: for the model types
transformers lists as shipping a wrong `tokenizer_class` on the Hub (qwen2 is one), it loads the
model type's own class (Qwen2Tokenizer), whose pipeline is built from the vocabulary and merges
rather than read from tokenizer.json, so its text can differ from the generic class's. Its
resolution imports transformers' config classes, and so torch, which the router must not load:
the two tables it reads (the model types' tokenizer classes, and the model types whose Hub class
is wrong) are read here from transformers' own source file, parsed and never imported. The
tokenizer classes themselves import without torch.
"""
from __future__ import annotations

import ast
import fnmatch
import functools
import importlib.util
import logging
from pathlib import Path

log = logging.getLogger(__name__)

GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast", "PythonBackend", "MistralCommonBackend")


def _value(node: ast.AST) -> object:
    """A table entry's value: a constant, or the class transformers names when its backend is
    installed (`"X" if is_tokenizers_available() else None`: tokenizers always is here)."""
    if isinstance(node, ast.IfExp):
        return _value(node.body)
    if isinstance(node, ast.Constant):
        return node.value
    return None


def _tables(source: str) -> tuple[dict[str, str], set[str], list[str]]:
    mapping: dict[str, str] = {}
    wrong_on_hub: set[str] = set()
    backend_ids: list[str] = []
    for stmt in ast.parse(source).body:
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) else getattr(stmt, "target", None)
        name = getattr(target, "id", None)
        value = getattr(stmt, "value", None)
        if name == "TOKENIZER_MAPPING_NAMES" and isinstance(value, ast.Call) and value.args:
            for pair in getattr(value.args[0], "elts", []):
                if isinstance(pair, ast.Tuple) and len(pair.elts) == 2:
                    key, cls = _value(pair.elts[0]), _value(pair.elts[1])
                    if isinstance(key, str) and isinstance(cls, str):
                        mapping[key] = cls
        elif name == "MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS" and isinstance(value, ast.Set):
            wrong_on_hub = {v for v in map(_value, value.elts) if isinstance(v, str)}
        elif name == "MODEL_IDS_TO_TOKENIZERS_BACKEND" and isinstance(value, ast.List):
            backend_ids = [v for v in map(_value, value.elts) if isinstance(v, str)]
    return mapping, wrong_on_hub, backend_ids


@functools.lru_cache(maxsize=1)
def _auto_tables() -> tuple[dict[str, str], set[str], list[str]] | None:
    spec = importlib.util.find_spec("transformers")  # a top-level find_spec imports nothing
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    source = next((p for p in (Path(r) / "models" / "auto" / "tokenization_auto.py" for r in roots) if p.is_file()),
                  None)
    if source is None:
        return None
    try:
        tables = _tables(source.read_text(encoding="utf-8"))
    except (SyntaxError, ValueError, OSError) as exc:
        log.warning("cannot read transformers' tokenizer table (%s): loading the generic tokenizer", exc)
        return None
    if not tables[0]:
        log.warning("transformers' tokenizer table not found in %s: loading the generic tokenizer", source)
        return None
    return tables


def auto_tokenizer_class(model_config: dict, tokenizer_config: dict) -> str | None:
    """The class AutoTokenizer loads for a checkpoint whose tokenizer_config names a generic class
    (these two files' contents), when it is another one; None: the generic class."""
    tables = _auto_tables()
    model_type = model_config.get("model_type")
    if tables is None or not isinstance(model_type, str):
        return None
    mapping, wrong_on_hub, backend_ids = tables
    name_or_path = str(model_config.get("_name_or_path") or "").lower()
    if any(fnmatch.fnmatch(name_or_path, pattern) for pattern in backend_ids):
        return None
    registered = (mapping.get(model_type) or "").removesuffix("Fast")
    if registered and registered not in GENERIC_TOKENIZERS and model_type in wrong_on_hub:
        return registered
    return None
