"""Incremental detokenization whose deltas add up to exactly `tokenizer.decode(ids, ...)`.

Fast tokenizers go through the `tokenizers` library's DecodeStream (what vLLM v1 uses): it keeps
the context a window decode loses, e.g. the space after a skipped special token in a WordLevel
or Metaspace vocabulary. DecodeStream holds back an incomplete UTF-8 tail for ever, where
`decode` renders it as U+FFFD, so the last step reconciles with one full decode. Slow tokenizers
fall back to vLLM's older prefix-window method.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - tokenizers < 0.21
    DecodeStream = None


class IncrementalDetokenizer:
    """One request's detokenizer. step() returns the text the newest token adds (maybe "")."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.spaces = spaces_between_special_tokens
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if DecodeStream is not None else None
        self._stream = DecodeStream(skip_special_tokens=self.skip) if self._backend is not None else None
        self.ids: list[int] = []
        self.text = ""  # what the steps so far produced
        self._prefix_offset = 0
        self._read_offset = 0

    def prime(self, ids: Sequence[int]) -> str:
        """Feed tokens whose text was produced elsewhere (the prefill node); returns that text."""
        for token in ids:
            self.step(token, finished=False)
        return self.text

    def step(self, token: int, finished: bool) -> str:
        self.ids.append(token)
        if self._stream is not None:
            piece = self._stream.step(self._backend, token) or ""
        else:
            piece = self._window_step(finished)
        if finished:
            piece = self._reconcile(piece)
        self.text += piece
        return piece

    def finish(self) -> str:
        """The rest of the text when the request ends on a token that is not shown (EOS)."""
        piece = self._reconcile("")
        self.text += piece
        return piece

    def decode(self, ids: Sequence[int]) -> str:
        kwargs = {} if self.spaces else {"spaces_between_special_tokens": False}
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip, **kwargs)

    def _reconcile(self, piece: str) -> str:
        full = self.decode(self.ids)
        so_far = self.text + piece
        # A held-back UTF-8 tail shows up as U+FFFD in the full decode; anything else that
        # differs (a tokenizer cleaning up earlier text) cannot be unsent, so keep the stream's.
        return full[len(self.text):] if full.startswith(self.text) and len(full) >= len(so_far) else piece

    def _window_step(self, finished: bool) -> str:
        ids = self.ids
        prefix = self.decode(ids[self._prefix_offset:self._read_offset])
        full = self.decode(ids[self._prefix_offset:])
        if full.endswith("\ufffd") and not finished:
            return ""  # an incomplete UTF-8 sequence: wait for the next byte token
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return full[len(prefix):]
