"""A checkpoint's tokenizer as a node uses it, kept as the `tokenizers` library's own JSON, so a
node that loads the same checkpoint again decodes without importing transformers.

A node never tokenizes (the router does); it turns ids into text (pdserve.engine.detokenizer),
stops on the EOS id and, for structured outputs, hands the vocabulary to xgrammar. Importing
transformers and building its tokenizer class cost 0.6 s of CPU, paid by every node start.
For the tokenizers whose decode is the `tokenizers` library's, unchanged (transformers' generic
fast class, with no clean-up that changes the text), the snapshot holds the library tokenizer
transformers built (its added and special tokens included), the EOS id, the length and the
added tokens. It is written by any process that loads the tokenizer with transformers (the
router and the nodes, pdserve.models.model_path.load_tokenizer), keyed by the tokenizer files'
bytes and transformers' version, and only after its decode has given transformers' text on the
whole vocabulary and on the text a clean-up would change. Anything else a caller asks of it
(xgrammar's vocabulary) loads transformers' tokenizer then (`SnapshotTokenizer.full`).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.cache_dir import cache_root

# The files transformers builds a tokenizer from (config.json: the model type picks the class).
KEY_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "config.json")
_FORMAT = "v1"
# Text that transformers' clean-up of tokenization spaces rewrites ("a ." -> "a."), for the check.
_CLEANUP_PROBE = "a . b , c ! d ? e n't f 'm g 's h 've i 're j ' k"
_DECODERS = ("TokenizersBackend", "PreTrainedTokenizerFast")  # whose _decode is the library's decode


class SnapshotTokenizer:
    """What a node's engine reads of a tokenizer, from its snapshot; `full()` is transformers'."""

    def __init__(self, path: Path, fields: dict[str, Any], load_full: Callable[[Path], Any] | None = None):
        """load_full(path): transformers' tokenizer of the checkpoint (model_path.load_tokenizer), for
        full(); None: a snapshot that only decodes (the save's check)."""
        from tokenizers import AddedToken, Tokenizer  # deferred: this module imports nothing heavy
        self.path, self._load_full = Path(path), load_full
        self.backend_tokenizer = Tokenizer.from_str(fields["backend"])
        self.eos_token_id = fields["eos_token_id"]
        self._length = int(fields["length"])
        self.added_tokens_decoder = {int(i): AddedToken(content, special=special)
                                     for i, content, special in fields["added"]}
        self._full = None
        self._loading = threading.Lock()  # a node loads it on a thread while a request may ask for it

    def __len__(self) -> int:
        return self._length

    def decode(self, ids, skip_special_tokens: bool = False, **kwargs) -> str:
        if kwargs.get("clean_up_tokenization_spaces"):  # asked for explicitly: transformers' own
            return self.full().decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)
        # spaces_between_special_tokens: the fast classes ignore it too
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def full(self):
        """transformers' tokenizer of the same checkpoint, loaded on first use."""
        with self._loading:
            if self._full is None:
                if self._load_full is None:
                    raise RuntimeError("this snapshot was made without a loader for transformers' tokenizer")
                self._full = self._load_full(self.path)
        return self._full


def snapshot_file(path: Path) -> Path | None:
    """Where the snapshot of `path`'s tokenizer lives; None without a tokenizer.json."""
    key = hashlib.sha256(f"{_transformers_version()}\0{_FORMAT}".encode())
    for name in KEY_FILES:
        try:
            data = (Path(path) / name).read_bytes()
        except FileNotFoundError:
            if name == "tokenizer.json":
                return None
            continue
        except OSError:
            return None
        key.update(f"\0{name}\0{len(data)}\0".encode())
        key.update(data)
    return cache_root() / "tokenizers" / f"{key.hexdigest()}.json"


def load_snapshot(path: Path, load_full: Callable[[Path], Any] | None = None) -> SnapshotTokenizer | None:
    """path's snapshot, or None; load_full: see SnapshotTokenizer."""
    file = snapshot_file(path)
    try:
        fields = json.loads(file.read_text(encoding="utf-8")) if file is not None else None
        return SnapshotTokenizer(path, fields, load_full) if isinstance(fields, dict) else None
    except Exception:  # unreadable, or a JSON the library refuses (its own error type): transformers' load instead
        return None


def save_snapshot(path: Path, tokenizer) -> None:
    """Keep `tokenizer` (transformers', of `path`) for later loads when a snapshot decodes as it
    does; a cache that cannot be written only costs the next load its import."""
    file = snapshot_file(path)
    if file is None or file.is_file() or not _library_decode(tokenizer):
        return
    fields = {"backend": tokenizer.backend_tokenizer.to_str(), "eos_token_id": tokenizer.eos_token_id,
              "length": len(tokenizer), "class": type(tokenizer).__name__,
              "added": [[i, t.content, bool(t.special)] for i, t in sorted(tokenizer.added_tokens_decoder.items())]}
    if not decodes_alike(SnapshotTokenizer(path, fields), tokenizer):
        return
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        # written whole, then renamed: nodes starting side by side never read half a file
        fd, staging = tempfile.mkstemp(dir=file.parent, prefix=".staging-")
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(fields, out)
        os.chmod(staging, 0o644)  # the cache is shared by every user's nodes
        os.replace(staging, file)
    except OSError:
        return


def decodes_alike(snapshot: SnapshotTokenizer, tokenizer) -> bool:
    """The snapshot's text is transformers' on every id (in runs of 64, special tokens kept and
    skipped), and on the text that transformers' clean-up of tokenization spaces would change."""
    vocab = list(range(len(tokenizer)))
    runs = [vocab[i:i + 64] for i in range(0, len(vocab), 64)]
    runs.append(tokenizer.encode(_CLEANUP_PROBE, add_special_tokens=False))
    return all(snapshot.decode(run, skip_special_tokens=skip) == tokenizer.decode(run, skip_special_tokens=skip)
               for run in runs for skip in (False, True))


def _library_decode(tokenizer) -> bool:
    """Whether decode is transformers' fast class's, which calls the library's decode (then
    maybe a clean-up, which decodes_alike catches): not a subclass's own."""
    def owner(name: str) -> type | None:
        return next((cls for cls in type(tokenizer).__mro__ if name in vars(cls)), None)
    decoder, entry = owner("_decode"), owner("decode")
    return (getattr(tokenizer, "backend_tokenizer", None) is not None and decoder is not None
            and decoder.__name__ in _DECODERS and decoder.__module__.startswith("transformers.")
            and entry is not None and entry.__name__ == "PreTrainedTokenizerBase")


def _transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "none"
