"""Structured outputs with xgrammar: compile a request's spec once per node process, keep one
matcher per request, mask the constrained rows of a batch with a token bitmask.

A request carries its spec (SamplingParams.structured), never matcher state: a node that takes
a generation over (the decode node after the prefill node drew the first token, or another
decode node after a failover) rebuilds the matcher and replays the tokens already produced.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch

from pdserve.models.tokenizer_snapshot import SnapshotTokenizer
from pdserve.protocol.grammar import (
    DEAD_END_FINISH,
    TOOL_CALL_MARKERS,
    choice_grammar,
    error_first_line,
    parse_choices,
    strict_json_grammar,
    structural_tag_grammar,
)
from pdserve.protocol.sampling_params import StructuredSpec

log = logging.getLogger(__name__)


class StructuredOutputs:
    """Per engine: the compiler (with its cache), the matchers' bitmask buffer."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: set[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._bitmask: torch.Tensor | None = None
        self._dead_ends: set[int] = set()  # id() of matchers that met a token off their grammar
        # Each spec is compiled once per engine (one per node process), the 256 latest kept.
        self.compiled = functools.lru_cache(maxsize=256)(self._compile)

    @functools.cached_property
    def compiler(self):
        return self._new_compiler({})

    @functools.cached_property
    def tag_compiler(self):
        """For tool-call structural tags: a call marker that is a special token of this tokenizer
        (TOOL_CALL_MARKERS) stays in the vocabulary as its text, so the tag's trigger opens on
        it (the router keeps such a marker in the output text, where the parser reads it). The
        plain compiler where the tokenizer has no such token."""
        kept = {i: t.content.encode() for i, t in self._added_tokens().items()
                if t.special and t.content in TOOL_CALL_MARKERS}
        return self._new_compiler(kept) if kept else self.compiler

    def _added_tokens(self) -> dict[int, Any]:
        return getattr(self.tokenizer, "added_tokens_decoder", {})

    def _xgrammar(self):
        """xgrammar, imported only once transformers' tokenizer is loaded. A node loads that on a
        thread of its own as it starts (pdserve.node.main); xgrammar imports transformers' tokenizer
        classes, and importing both on two threads at once failed a soak's first regex request on
        a restarted prefill node ("cannot import name 'PreTrainedTokenizerBase'"). full() waits
        for that thread's load."""
        if isinstance(self.tokenizer, SnapshotTokenizer):
            self.tokenizer.full()
        import xgrammar as xgr  # heavy: loaded once a request names a grammar
        return xgr

    def _new_compiler(self, kept: dict[int, bytes]):
        if self.tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer, and this model has none")
        xgr = self._xgrammar()
        stops = self.stop_token_ids or None
        # xgrammar reads transformers' class: a node's tokenizer snapshot holds it (_xgrammar loaded it)
        hf = self.tokenizer.full() if isinstance(self.tokenizer, SnapshotTokenizer) else self.tokenizer
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size, stop_token_ids=stops)
        # Special tokens are dropped from the output text (skip_special_tokens), so the grammar
        # must never allow them: an empty entry is what xgrammar treats as special. Rebuilt from
        # the decoded bytes (RAW), which also holds strings to JSON's rules on this byte-level
        # vocabulary (from_huggingface's BYTE_LEVEL info let raw control bytes into strings).
        special = {i for i, t in self._added_tokens().items() if t.special and i not in self.stop_token_ids}
        vocab = [kept.get(i, b"") if i in special else piece for i, piece in enumerate(info.decoded_vocab)]
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size, stop_token_ids=stops,
                                 add_prefix_space=info.add_prefix_space)
        return xgr.GrammarCompiler(info, cache_enabled=True)

    def _compile(self, kind: str, spec: str):
        compiler = self.compiler
        try:
            if kind == "json":
                return compiler.compile_grammar(strict_json_grammar(spec))
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(parse_choices(spec)))
            if kind == "structural_tag":  # only tool calls build them (router.openai.tool_tags)
                return self.tag_compiler.compile_grammar(structural_tag_grammar(spec))
            return compiler.compile_grammar(spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"invalid {kind} for structured output: {error_first_line(exc)}") from None

    def new_matcher(self, spec: StructuredSpec, produced: Sequence[int]):
        """A matcher advanced past the tokens already produced (drawn on another node)."""
        xgr = self._xgrammar()
        matcher = xgr.GrammarMatcher(self.compiled(spec.kind, spec.spec))
        for token in produced:
            if not matcher.accept_token(int(token)):
                raise ValueError(f"token {token} already produced does not match the {spec.kind} grammar")
        return matcher

    def check_satisfiable(self, spec: StructuredSpec) -> None:
        """ValueError when no token of this vocabulary can start an output the grammar accepts
        (say, a pattern of characters no token spells): refused before generating, instead of
        an empty answer that looks like success."""
        matcher = self.new_matcher(spec, ())
        bitmask = self._bitmask_for(1)
        matcher.fill_next_token_bitmask(bitmask, 0)
        if not bool(bitmask[0].any()):
            raise ValueError(f"the {spec.kind} constraint cannot be satisfied with this model's vocabulary: "
                             "no token can start an output it accepts")

    def apply_bitmask(self, logits: torch.Tensor, matchers: Sequence[Any]) -> None:
        """Mask logits [B, vocab] rows whose matcher is not None; other rows pay nothing."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        import xgrammar as xgr  # heavy: loaded once a request names a grammar
        bitmask = self._bitmask_for(len(matchers))
        for i in rows:
            matchers[i].fill_next_token_bitmask(bitmask, i)
        on_device = bitmask[:len(matchers)].to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, on_device, vocab_size=logits.shape[-1], indices=rows)
        self._end_dead_ends(logits, rows)

    def _end_dead_ends(self, logits: torch.Tensor, rows: list[int]) -> None:
        """A row with no token left (the grammar allows none of this vocabulary here, or the
        other edits barred every one it allows) draws a stop token, which ends the request
        without text; accept() then finds it off-grammar and calls it a dead end."""
        dead = torch.isneginf(logits[rows]).all(dim=-1).nonzero().flatten().tolist()
        if dead and self.stop_token_ids:
            stops = torch.tensor(self.stop_token_ids, device=logits.device)
            for k in dead:
                logits[rows[k], stops] = 0.0

    def _bitmask_for(self, batch: int) -> torch.Tensor:
        import xgrammar as xgr  # heavy: loaded once a request names a grammar
        if self._bitmask is None or self._bitmask.shape[0] < batch:
            self._bitmask = xgr.allocate_token_bitmask(max(batch, 8), self.vocab_size)
        return self._bitmask

    def accept(self, matcher: Any, token: int) -> bool:
        """Advance past the drawn token; True when the request must end: the grammar is
        complete, or the token is off-grammar: a dead end (no token of the vocabulary fits the
        grammar here, or other edits, bad words or min_tokens, barred every one that did)."""
        if not matcher.accept_token(int(token)):
            log.warning("token %d is outside the grammar (no allowed token could be drawn): ending", token)
            self._dead_ends.add(id(matcher))
            return True
        return matcher.is_terminated()

    def finish_reason(self, matcher: Any, reason: str | None) -> str | None:
        """The finish reason of a request ending with this matcher: DEAD_END_FINISH after a dead end."""
        if id(matcher) in self._dead_ends:
            self._dead_ends.discard(id(matcher))
            return DEAD_END_FINISH
        return reason
