"""A node's compatibility descriptor (pdserve.wire.compat.KVCompat), built once from its engine
and again whenever its LoRA adapters change; it travels in every pong.

The model is named by a digest of its files, not its path: two hosts with the same path may hold
different weights (another revision, another seed), and such a pair would hand over KV that the
decode node's model never computed. Files up to WHOLE_FILE_BYTES are hashed whole; a larger one
by its size, its first and last MiB and SAMPLES evenly spaced MiB, which any retrained or
re-quantized checkpoint changes, at a cost that does not grow with the model.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import xxhash

from pdserve.wire.compat import WHOLE_BLOCK_MAJOR, KVCompat

WHOLE_FILE_BYTES = 256 << 20
SAMPLES = 64
_MIB = 1 << 20
# What holds weights or changes what they compute; tokenizers and templates do not touch the KV.
_MODEL_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf", ".json")
_SKIPPED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
            "preprocessor_config.json", "chat_template.json")


def _file_digest(path: Path, h: xxhash.xxh3_128) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}|{size}|".encode())
    with open(path, "rb") as f:
        if size <= WHOLE_FILE_BYTES:
            for chunk in iter(lambda: f.read(8 * _MIB), b""):
                h.update(chunk)
            return
        for i in range(SAMPLES + 2):
            offset = 0 if i == 0 else size - _MIB if i == 1 else (size - _MIB) * (i - 1) // (SAMPLES + 1)
            f.seek(offset)
            h.update(f.read(_MIB))


@functools.lru_cache(maxsize=16)
def _dir_digest(directory: str, stamp: tuple) -> str:
    h = xxhash.xxh3_128()
    for path in sorted(Path(directory).iterdir()):
        if path.is_file() and path.name.endswith(_MODEL_SUFFIXES) and path.name not in _SKIPPED:
            _file_digest(path, h)
    return h.hexdigest()


def files_digest(directory: str | Path) -> str:
    """The digest of a model's (or an adapter's) files, cached by their sizes and mtimes."""
    directory = os.path.realpath(directory)
    stamp = tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(directory)
                         if e.is_file()))
    return _dir_digest(directory, stamp)


def _speculative(config) -> str:
    spec = config.speculative_config
    if spec is None:
        return ""
    model = Path(spec.model).name if spec.model else ""
    return f"{spec.method}:{spec.num_speculative_tokens}:{model}"


class NodeCompat:
    """Builds the engine's KVCompat; `current()` is cheap (pongs call it) and rebuilds only when
    the node's LoRA adapters changed."""

    def __init__(self, engine):
        self.engine = engine
        self._loras: tuple = ()
        self._compat = self._build()

    def _build(self) -> KVCompat:
        engine, layout, config = self.engine, self.engine.kv_layout, self.engine.config
        loras = {}
        if engine.lora is not None:
            loras = {name: files_digest(path) for name, path in engine.lora.paths.items()}
        return KVCompat(files_digest(engine.model_path), str(engine.dtype).removeprefix("torch."),
                        layout.dtype_name, layout.block_size, layout.planes, layout.num_layers,
                        layout.num_kv_heads, layout.head_dim, WHOLE_BLOCK_MAJOR,
                        config.tensor_parallel_size, getattr(config, "pipeline_parallel_size", 1),
                        _speculative(config), loras,
                        engine.kv.states.layout if engine.kv.states is not None else "")

    def current(self) -> KVCompat:
        lora = self.engine.lora
        names = tuple(lora.paths.items()) if lora is not None else ()
        if names != self._loras:
            self._loras, self._compat = names, self._build()
        return self._compat
