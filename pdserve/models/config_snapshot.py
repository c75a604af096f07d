"""A checkpoint's config as transformers resolved it, kept as JSON so a process that loads the
same checkpoint again reads it without importing transformers' config classes.

Importing them costs about 2.4 s of CPU (they pull in transformers.activations, accelerate and
torch.distributed.tensor), half of a `builtin:tiny` node's start on a 2-core machine, paid by
every node, tensor-parallel worker and draft model a cluster starts. The snapshot is what
transformers itself gave (`to_dict()`, class defaults and rope_parameters included), keyed by
config.json's bytes and transformers' version, in the cache directory; the loader validates the
config as before either way (pdserve.models.loader.load_hf_config).

Only plain Llama-family text configs are snapshotted: default RoPE, no quantization_config, no
custom code. Their readers only read attributes. Scaled RoPE hands the config to transformers'
own init functions, quantized and family checkpoints hold sub-configs and objects: those keep
transformers' classes.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

from pdserve.cache_dir import cache_root

PLAIN_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_FORMAT = "v1"


class SnapshotConfig(SimpleNamespace):
    """The snapshot's fields as attributes, plus the accessors PretrainedConfig defines over them
    (a reader written against transformers' config finds them here too)."""

    @property
    def rope_scaling(self):
        return self.rope_parameters

    @property
    def name_or_path(self):
        return getattr(self, "_name_or_path", None)

    @property
    def torch_dtype(self):
        return self.dtype

    @property
    def use_return_dict(self):
        return self.return_dict

    @property
    def num_labels(self):
        return len(self.id2label) if self.id2label is not None else None


_ACCESSORS = {name for name, value in vars(SnapshotConfig).items() if isinstance(value, property)}


def snapshot_file(path: Path) -> Path | None:
    """Where the snapshot of `path`'s config.json lives; None without a config.json."""
    try:
        data = (Path(path) / "config.json").read_bytes()
    except OSError:
        return None
    key = hashlib.sha256(data)
    key.update(f"\0{_transformers_version()}\0{_FORMAT}".encode())
    return cache_root() / "configs" / f"{key.hexdigest()}.json"


def load_snapshot(path: Path) -> SnapshotConfig | None:
    file = snapshot_file(path)
    try:
        fields = json.loads(file.read_text(encoding="utf-8")) if file is not None else None
    except (OSError, ValueError):
        return None
    if not isinstance(fields, dict):
        return None
    if isinstance(fields.get("id2label"), dict):  # JSON made its int keys strings
        fields["id2label"] = {int(k): v for k, v in fields["id2label"].items()}
    if isinstance(fields.get("dtype"), str):  # as PretrainedConfig.__init__: a torch dtype, not its name
        import torch  # deferred: the loader has it; this module stays importable without it
        if isinstance(dtype := getattr(torch, fields["dtype"], None), torch.dtype):
            fields["dtype"] = dtype
    # an accessor's own name among the fields (an older to_dict's) would collide with the property
    return SnapshotConfig(**{k: v for k, v in fields.items() if k not in _ACCESSORS})


def save_snapshot(path: Path, config) -> None:
    """Keep transformers' `config` of `path` for later loads, when it is a plain one; a cache that
    cannot be written only costs the next load its import."""
    file = snapshot_file(path)
    if file is None or not snapshottable(config):
        return
    try:
        text = json.dumps(config.to_dict())
    except (TypeError, ValueError):  # a field JSON cannot hold: not a plain config after all
        return
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        # written whole, then renamed: nodes starting side by side never read half a file
        fd, staging = tempfile.mkstemp(dir=file.parent, prefix=".staging-")
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(staging, 0o644)  # the cache is shared by every user's nodes
        os.replace(staging, file)
    except OSError:
        return


def snapshottable(config) -> bool:
    archs = getattr(config, "architectures", None) or []
    rope = getattr(config, "rope_parameters", None) or {}
    return (len(archs) == 1 and archs[0] in PLAIN_ARCHITECTURES
            and not getattr(config, "quantization_config", None)
            and not getattr(config, "auto_map", None)
            and rope.get("rope_type", "default") == "default")


def _transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "none"
