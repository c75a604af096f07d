"""Builders for OpenAI response bodies: completion, chat.completion and their .chunk shapes.

Plain dicts (not pydantic) because they are built once per token on the hot streaming path.
A `Flavor` holds what differs between /v1/completions and /v1/chat/completions, so the
streaming and non-streaming paths share one accumulation of StepOutput deltas.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.outputs import StepOutput, TokenLogprob


class TokenTexts:
    """Per-token strings for logprobs; cached because the same ids recur across requests."""

    def __init__(self, tokenizer: Any, max_entries: int = 65536) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._max_entries = max_entries

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id])
            if len(self._cache) < self._max_entries:
                self._cache[token_id] = text
        return text


@dataclass
class ChoiceState:
    """Everything one choice produced so far."""
    index: int
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    # Sum of the logprob token strings so far: the base of the next `text_offset`.
    logprob_offset: int = 0

    def add(self, out: StepOutput) -> None:
        self.text_parts.append(out.new_text)
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.new_logprobs or [])
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.finished:
            self.finish_reason = out.finish_reason

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def usage(prompt_tokens: int, states: list[ChoiceState]) -> dict[str, Any]:
    completion = sum(len(s.token_ids) for s in states)
    cached = max((s.num_cached_tokens for s in states), default=0)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def completion_logprobs(texts: TokenTexts, lps: list[TokenLogprob],
                        base_offset: int) -> tuple[dict[str, Any], int]:
    """Legacy completions shape; returns it and the offset after the last token."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = base_offset
    for lp in lps:
        token = texts(lp.token_id)
        tokens.append(token)
        token_lps.append(lp.logprob)
        top = {texts(tid): value for tid, value in lp.top}
        top.setdefault(token, lp.logprob)
        tops.append(top)
        offsets.append(offset)
        offset += len(token)
    body = {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}
    return body, offset


def _chat_token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(texts: TokenTexts, lps: list[TokenLogprob]) -> dict[str, Any]:
    content = []
    for lp in lps:
        entry = _chat_token(texts(lp.token_id), lp.logprob)
        entry["top_logprobs"] = [_chat_token(texts(tid), value) for tid, value in lp.top]
        content.append(entry)
    return {"content": content}


class Flavor:
    """What differs between the completions and chat endpoints."""
    object_name = ""
    chunk_object = ""

    def __init__(self, texts: TokenTexts, want_logprobs: bool, return_token_ids: bool) -> None:
        self.texts = texts
        self.want_logprobs = want_logprobs
        self.return_token_ids = return_token_ids

    def choice(self, state: ChoiceState) -> dict[str, Any]:
        raise NotImplementedError

    def chunk_choice(self, state: ChoiceState, out: StepOutput) -> dict[str, Any]:
        """The delta for `out`; call before state.add(out)."""
        raise NotImplementedError

    def opening_choices(self, n: int) -> list[dict[str, Any]]:
        return []

    def _with_ids(self, choice: dict[str, Any], token_ids: list[int]) -> dict[str, Any]:
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return choice


class CompletionFlavor(Flavor):
    object_name = "text_completion"
    chunk_object = "text_completion"  # OpenAI streams legacy completions with the same object

    def __init__(self, texts: TokenTexts, want_logprobs: bool, return_token_ids: bool,
                 echo_text: str | None = None) -> None:
        super().__init__(texts, want_logprobs, return_token_ids)
        self.echo_text = echo_text  # `echo`: the prompt, before the completion

    def choice(self, state: ChoiceState) -> dict[str, Any]:
        lps = completion_logprobs(self.texts, state.logprobs, 0)[0] if self.want_logprobs else None
        body = {"index": state.index, "text": (self.echo_text or "") + state.text, "logprobs": lps,
                "finish_reason": state.finish_reason}
        return self._with_ids(body, state.token_ids)

    def chunk_choice(self, state: ChoiceState, out: StepOutput) -> dict[str, Any]:
        lps = None
        if self.want_logprobs:
            lps, state.logprob_offset = completion_logprobs(
                self.texts, out.new_logprobs or [], state.logprob_offset)
        body = {"index": state.index, "text": out.new_text, "logprobs": lps,
                "finish_reason": out.finish_reason if out.finished else None}
        return self._with_ids(body, out.new_token_ids)

    def opening_choices(self, n: int) -> list[dict[str, Any]]:
        # vLLM streams the echoed prompt as each choice's first delta.
        if not self.echo_text:
            return []
        return [self._with_ids({"index": i, "text": self.echo_text, "logprobs": None, "finish_reason": None}, [])
                for i in range(n)]


class ChatFlavor(Flavor):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def choice(self, state: ChoiceState) -> dict[str, Any]:
        lps = chat_logprobs(self.texts, state.logprobs) if self.want_logprobs else None
        body = {"index": state.index,
                "message": {"role": "assistant", "content": state.text},
                "logprobs": lps, "finish_reason": state.finish_reason}
        return self._with_ids(body, state.token_ids)

    def chunk_choice(self, state: ChoiceState, out: StepOutput) -> dict[str, Any]:
        lps = chat_logprobs(self.texts, out.new_logprobs or []) if self.want_logprobs else None
        body = {"index": state.index, "delta": {"content": out.new_text}, "logprobs": lps,
                "finish_reason": out.finish_reason if out.finished else None}
        return self._with_ids(body, out.new_token_ids)

    def opening_choices(self, n: int) -> list[dict[str, Any]]:
        # OpenAI opens each chat choice with a role-only delta.
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(n)]


def response_body(flavor: Flavor, request_id: str, created: int, model: str,
                  states: list[ChoiceState], prompt_tokens: int) -> dict[str, Any]:
    return {"id": request_id, "object": flavor.object_name, "created": created,
            "model": model, "system_fingerprint": None,
            "choices": [flavor.choice(s) for s in states],
            "usage": usage(prompt_tokens, states)}


def chunk_body(flavor: Flavor, request_id: str, created: int, model: str,
               choices: list[dict[str, Any]],
               usage_body: dict[str, Any] | None = None) -> dict[str, Any]:
    body = {"id": request_id, "object": flavor.chunk_object, "created": created,
            "model": model, "system_fingerprint": None, "choices": choices}
    if usage_body is not None:
        body["usage"] = usage_body
    return body
