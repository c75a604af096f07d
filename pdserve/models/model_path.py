"""Where a model named on the command line lives: a builtin model, an installed GGUF (as its
Hugging Face view) or a local Hugging Face directory. No torch: the router resolves the model
to find its tokenizer and chat template."""
from __future__ import annotations

from pathlib import Path

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
