"""Where a model named on the command line lives: a builtin model, an installed GGUF (as its
Hugging Face view) or a local Hugging Face directory. No torch: the router resolves the model
to find its tokenizer and chat template."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from pdserve.models.gguf import find_gguf_file, prepare_view


class ModelLoadError(ValueError):
    pass


def resolve_model_path(model: str) -> Path:
    if model.startswith("builtin:"):
        from pdserve.models.builtin import ensure_builtin_model  # numpy and the builtin model writer, only for builtin:
        return ensure_builtin_model(model)
    gguf_file = find_gguf_file(model)
    if gguf_file is not None:
        return prepare_view(gguf_file)
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"model directory {model!r} does not exist (pdserve loads local Hugging Face "
                             f"directories or builtin:tiny; it never downloads)")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json")
    return path


# Tokenizer classes that are transformers' generic fast tokenizer over tokenizer.json: when a
# checkpoint names one of these, AutoTokenizer loads that same class.
_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer, as AutoTokenizer loads it. A checkpoint whose tokenizer_config
    names the generic fast tokenizer is loaded by that class directly, which keeps torch out of
    the router process (AutoTokenizer's resolution imports transformers' config module, and so
    torch); the router and the nodes both load through here, so they always tokenize alike."""
    config = _read_json(path / "tokenizer_config.json")
    if (config.get("tokenizer_class") in _GENERIC_TOKENIZERS and "auto_map" not in config
            and (path / "tokenizer.json").is_file()):
        from transformers import PreTrainedTokenizerFast  # heavy (transformers), deferred on purpose
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer  # a specialised tokenizer class: transformers' own resolution
    return AutoTokenizer.from_pretrained(str(path))


def read_model_config(path: Path) -> SimpleNamespace:
    """config.json's fields as attributes, without transformers' config classes (which import
    torch): what the router reads of a model (layers, heads, context length) is written there
    by save_pretrained, class defaults included. A vision-language model's text_config fields
    are read as the model's own (as the engine's loader flattens them)."""
    config = _read_json(path / "config.json")
    text = config.get("text_config")
    if isinstance(text, dict) and config.get("vision_config") is not None:
        config = {**config, **text, "architectures": config.get("architectures")}
    return SimpleNamespace(**config)


def eos_token_ids(hf_config, tokenizer) -> set[int]:
    """The ids that end a generation: config.json's eos_token_id (one or a list) and the
    tokenizer's. The engine stops on these, and the router's beam search finishes beams on them."""
    eos = getattr(hf_config, "eos_token_id", None)
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _read_json(file: Path) -> dict:
    return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
