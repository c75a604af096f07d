"""The layout of a GGUF file: its scalar metadata and where each tensor's bytes lie.

gguf-py's GGUFReader builds a memory-mapped view of every metadata element, the tokenizer's
tens of thousands of strings included, which takes seconds per node start. Loading weights needs
only the tensor table, so this reads the header with struct and skips the arrays.

Format (little-endian; github.com/ggml-org/ggml/blob/master/docs/gguf.md): magic "GGUF",
version u32, tensor count u64, metadata count u64; the metadata key/value pairs; per tensor its
name, dimension count u32, dimensions u64 (innermost first), ggml type u32 and offset u64 from
the start of the data section, which begins at the next multiple of general.alignment.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


class GGUFFormatError(ValueError):
    pass


@dataclass
class TensorEntry:
    name: str
    dims: tuple[int, ...]  # innermost (contiguous) first, as GGUF stores them
    ggml_type: int
    offset: int            # absolute, in bytes from the start of the file

    def raw(self, data, gguf):
        """The tensor's bytes as gguf.dequantize takes them: rows of packed blocks."""
        import numpy as np  # deferred: numpy only reads weights; the router imports this module
        qtype = gguf.GGMLQuantizationType(self.ggml_type)
        block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
        rows = int(np.prod(self.dims[1:], dtype=np.int64)) if len(self.dims) > 1 else 1
        row_bytes = self.dims[0] // block * type_bytes
        raw = data[self.offset:self.offset + rows * row_bytes].reshape(*reversed(self.dims[1:]), row_bytes)
        if qtype == gguf.GGMLQuantizationType.F32:
            return raw.view(np.float32)
        if qtype == gguf.GGMLQuantizationType.F16:
            return raw.view(np.float16)
        return raw


@dataclass
class GGUFLayout:
    version: int
    metadata: dict = field(default_factory=dict)  # scalars and strings; arrays are skipped
    tensors: list[TensorEntry] = field(default_factory=list)


class _Cursor:
    def __init__(self, buf: bytes):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        self.pos += n
        return self.buf[self.pos - n:self.pos].decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            self.skip_array()
            return None
        raise GGUFFormatError(f"unknown GGUF value type {kind}")

    def skip_array(self) -> None:
        kind, count = self.take("<I"), self.take("<Q")
        if kind in _SCALARS:
            self.pos += count * struct.calcsize(_SCALARS[kind])
            return
        for _ in range(count):
            self.value(kind)


def read_layout(path: Path) -> GGUFLayout:
    """Parse the header (metadata and tensor table) of a GGUF file."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise GGUFFormatError(f"{path} is not a GGUF file (magic {buf[:4]!r})")
        try:
            return _parse(_Cursor(buf))
        except (struct.error, ValueError) as exc:
            raise GGUFFormatError(f"{path}: truncated or corrupt GGUF header ({exc})") from exc


def _parse(cur: _Cursor) -> GGUFLayout:
    cur.pos = 4
    layout = GGUFLayout(version=cur.take("<I"))
    if layout.version < 2:
        raise GGUFFormatError(f"GGUF version {layout.version} is not supported (2 or later)")
    n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
    for _ in range(n_kv):
        key = cur.string()
        value = cur.value(cur.take("<I"))
        if value is not None:
            layout.metadata[key] = value
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.take("<Q") for _ in range(cur.take("<I")))
        infos.append((name, dims, cur.take("<I"), cur.take("<Q")))
    align = int(layout.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = (cur.pos + align - 1) // align * align
    layout.tensors = [TensorEntry(n, d, t, data_start + o) for n, d, t, o in infos]
    return layout
