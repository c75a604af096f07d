"""Where a model named on the command line lives: a builtin model, an installed GGUF (as its
Hugging Face view), a local Hugging Face directory, or a Hub id (ORG/NAME) already in the local
Hugging Face cache (HF_HOME, HF_HUB_CACHE; its refs/main snapshot). Nothing is downloaded. No
torch: the router resolves the model to find its tokenizer and chat template."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

from pdserve.models.gguf import find_gguf_file, prepare_view
from pdserve.models.tokenizer_class import GENERIC_TOKENIZERS, auto_tokenizer_class
from pdserve.models.tokenizer_snapshot import load_snapshot, save_snapshot


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
    if not path.is_dir() and HUB_ID.fullmatch(model):
        path = cached_snapshot(model)
    elif not path.is_dir():
        raise ModelLoadError(f"model directory {model!r} does not exist (pdserve loads local Hugging Face "
                             f"directories, Hub ids already in the local Hugging Face cache, and builtin:tiny; "
                             f"it never downloads)")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json")
    return path


# A Hub repository id as huggingface_hub takes it: ORG/NAME, neither part a path's "." or "..".
HUB_ID = re.compile(r"(?!\.\.?/)[A-Za-z0-9][\w.-]{0,95}/(?!\.\.?$)[\w.-]{1,96}")


def cached_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot of repo_id that the local Hugging Face cache holds (refs/main unless a revision
    is given), found without any network access; ModelLoadError when it holds none."""
    from huggingface_hub import constants, snapshot_download  # deferred: only Hub ids need it
    from huggingface_hub.errors import LocalEntryNotFoundError
    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError) as exc:
        at = f" at revision {revision!r}" if revision else ""
        raise ModelLoadError(
            f"{repo_id!r} is not a local directory, and the Hugging Face cache ({constants.HF_HUB_CACHE}) holds "
            f"no snapshot of it{at}: pdserve never downloads. Fetch it first (huggingface-cli download {repo_id}), "
            f"or point HF_HOME or HF_HUB_CACHE at the cache that holds it ({type(exc).__name__})") from None


def context_limit(hf_config) -> int | None:
    """The longest sequence the model's config allows (None: it names none): the smallest of the
    keys vLLM reads for it (max_position_embeddings and the older names)."""
    keys = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")
    found = [v for v in (getattr(hf_config, k, None) for k in keys) if isinstance(v, int) and v > 0]
    return min(found) if found else None


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer, of the class AutoTokenizer loads. A checkpoint whose
    tokenizer_config names the generic fast tokenizer is loaded by the class AutoTokenizer would
    pick (tokenizer_class.py: the generic one, or its model type's own for the model types
    transformers lists) without AutoTokenizer's resolution, which imports transformers' config
    module, and so torch, which the router must not load; the router and the nodes both load
    through here, so they always tokenize alike."""
    config = _read_json(path / "tokenizer_config.json")
    if (config.get("tokenizer_class") in GENERIC_TOKENIZERS[:2] and "auto_map" not in config
            and (path / "tokenizer.json").is_file()):
        import transformers  # heavy (transformers), deferred on purpose; its tokenizer classes load no torch
        name = auto_tokenizer_class(_read_json(path / "config.json"), config) or "PreTrainedTokenizerFast"
        tokenizer = getattr(transformers, name).from_pretrained(str(path))
    else:
        from transformers import AutoTokenizer  # a specialised tokenizer class: transformers' own resolution
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    save_snapshot(path, tokenizer)  # for the nodes' next start (load_decode_tokenizer)
    return tokenizer


def load_decode_tokenizer(path: Path):
    """What a node decodes with: the tokenizer's snapshot (pdserve.models.tokenizer_snapshot),
    which needs no transformers, when an earlier load left one; else transformers' (load_tokenizer)."""
    return load_snapshot(path, load_tokenizer) or load_tokenizer(path)


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
