"""Builders for OpenAI response bodies: completion, chat.completion and their .chunk shapes.

Plain dicts (not pydantic) because they are built once per token on the hot streaming path.
A `Flavor` holds what differs between /v1/completions and /v1/chat/completions, so the
streaming and non-streaming paths share one accumulation of StepOutput deltas.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pdserve.protocol.grammar import DEAD_END_FINISH, DEAD_END_MESSAGE
from pdserve.protocol.outputs import StepOutput, TokenLogprob

# JSON has no -Infinity or NaN: a token a grammar or a ban rules out has logprob -inf, and such a
# value would fail the response (or reach a client as invalid JSON). vLLM's server clamps to this.
LOGPROB_FLOOR = -9999.0


def finite_logprob(value: float) -> float:
    """The logprob as a client gets it: -inf and NaN become LOGPROB_FLOOR (NaN compares false)."""
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR


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
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, out: StepOutput) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
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
    """prompt_tokens: of every prompt, each counted once however many choices it has."""
    completion = sum(len(s.token_ids) for s in states)
    cached = max((s.num_cached_tokens for s in states), default=0)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def completion_logprobs(texts: TokenTexts, lps: list[TokenLogprob | None],
                        base_offset: int, first_token: int | None = None,
                        top_n: int | None = None) -> tuple[dict[str, Any], int]:
    """Legacy completions shape; returns it and the offset after the last token. A None entry
    (an echoed prompt's first token, `first_token`) has no logprob, as in OpenAI's answers."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = base_offset
    for lp in lps:
        token = texts(lp.token_id if lp is not None else first_token)
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
        if lp is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(finite_logprob(lp.logprob))
        top = {texts(tid): finite_logprob(value) for tid, value in lp.top[:top_n]}
        top.setdefault(token, finite_logprob(lp.logprob))
        tops.append(top)
    body = {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}
    return body, offset


def vllm_prompt_logprobs(texts: TokenTexts, lps: list[TokenLogprob | None] | None
                         ) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, {token id: {logprob, rank, decoded_token}}
    for the prompt's token and the top-N; None for the first token."""
    if lps is None:
        return None
    out: list[dict[str, Any] | None] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        entry = {str(lp.token_id): {"logprob": finite_logprob(lp.logprob), "rank": lp.rank,
                                    "decoded_token": texts(lp.token_id)}}
        for rank, (tid, value) in enumerate(lp.top, 1):
            entry.setdefault(str(tid), {"logprob": finite_logprob(value), "rank": rank, "decoded_token": texts(tid)})
        out.append(entry)
    return out


def _chat_token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": finite_logprob(logprob), "bytes": list(token.encode("utf-8"))}


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
    want_prompt_logprobs = False  # vLLM's `prompt_logprobs` asked for

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

    def shown(self, out: StepOutput) -> StepOutput:
        """What of a node's output the client sees (all of it, unless a flavor says not)."""
        return out

    def prompt_logprobs(self, state: ChoiceState) -> list[dict[str, Any] | None] | None:
        return vllm_prompt_logprobs(self.texts, state.prompt_logprobs)

    def _with_ids(self, choice: dict[str, Any], token_ids: list[int]) -> dict[str, Any]:
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return choice


class CompletionFlavor(Flavor):
    """Choice i*n+j answers prompt i. `echo`: each prompt's text, put before its completions
    (with logprobs, the prompt's tokens and logprobs come first too, the first one None).
    `echo_only` (max_tokens 0 with echo): the token the engine drew is not shown."""
    object_name = "text_completion"
    chunk_object = "text_completion"  # OpenAI streams legacy completions with the same object

    def __init__(self, texts: TokenTexts, want_logprobs: bool, return_token_ids: bool,
                 echo: list[str] | None = None, prompts: list[list[int]] | None = None, n: int = 1,
                 echo_only: bool = False, top_logprobs: int | None = None,
                 want_prompt_logprobs: bool = False) -> None:
        super().__init__(texts, want_logprobs, return_token_ids)
        self.echo, self.prompts, self.n = echo, prompts or [], n
        self.echo_only, self.top_logprobs = echo_only, top_logprobs
        self.want_prompt_logprobs = want_prompt_logprobs  # vLLM's field, beside `logprobs`

    def _echo(self, index: int) -> str:
        return self.echo[index // self.n] if self.echo else ""

    def _logprobs(self, state: ChoiceState, lps: list[TokenLogprob], with_prompt: bool) -> dict[str, Any]:
        entries: list[TokenLogprob | None] = list(lps)
        first = None
        if with_prompt and self.echo:
            entries = list(state.prompt_logprobs or []) + entries
            first = self.prompts[state.index // self.n][0]
        body, state.logprob_offset = completion_logprobs(self.texts, entries, state.logprob_offset, first,
                                                         self.top_logprobs)
        return body

    def _extras(self, body: dict[str, Any], state: ChoiceState, token_ids: list[int],
                with_prompt_logprobs: bool) -> dict[str, Any]:
        if self.want_prompt_logprobs and with_prompt_logprobs:
            body["prompt_logprobs"] = self.prompt_logprobs(state)
        return self._with_ids(body, token_ids)

    def shown(self, out: StepOutput) -> StepOutput:
        if not self.echo_only:
            return out
        return dataclasses.replace(out, new_token_ids=[], new_text="", new_logprobs=None,
                                   finish_reason="length" if out.finished else None)

    def choice(self, state: ChoiceState) -> dict[str, Any]:
        state.logprob_offset = 0
        lps = self._logprobs(state, state.logprobs, True) if self.want_logprobs else None
        body = {"index": state.index, "text": self._echo(state.index) + state.text, "logprobs": lps,
                "finish_reason": state.finish_reason}
        return self._extras(body, state, state.token_ids, True)

    def chunk_choice(self, state: ChoiceState, out: StepOutput) -> dict[str, Any]:
        # The first delta of a choice carries the echoed prompt (and its logprobs, which come
        # with the first token) unless opening_choices sent it already.
        opening = not state.token_ids and not state.text_parts and self._echo_in_first_chunk
        if out.prompt_logprobs is not None:
            state.prompt_logprobs = out.prompt_logprobs
        lps = self._logprobs(state, out.new_logprobs or [], opening) if self.want_logprobs else None
        text = (self._echo(state.index) if opening else "") + out.new_text
        body = {"index": state.index, "text": text, "logprobs": lps,
                "finish_reason": out.finish_reason if out.finished else None}
        return self._extras(body, state, out.new_token_ids, out.prompt_logprobs is not None)

    @property
    def _echo_in_first_chunk(self) -> bool:
        return bool(self.echo) and self.want_logprobs

    def opening_choices(self, n: int) -> list[dict[str, Any]]:
        # vLLM streams the echoed prompt as each choice's first delta (with logprobs it waits
        # for the prompt's logprobs, which come with the first token).
        if not self.echo or self._echo_in_first_chunk:
            return []
        return [self._with_ids({"index": i, "text": self._echo(i), "logprobs": None, "finish_reason": None}, [])
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
        if self.want_prompt_logprobs and out.prompt_logprobs is not None:
            body["prompt_logprobs"] = vllm_prompt_logprobs(self.texts, out.prompt_logprobs)
        return self._with_ids(body, out.new_token_ids)

    def opening_choices(self, n: int) -> list[dict[str, Any]]:
        # OpenAI opens each chat choice with a role-only delta.
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(n)]


def _explain_dead_ends(choices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A choice whose grammar met a dead end says why, in vLLM's `stop_reason` field."""
    for choice in choices:
        if choice.get("finish_reason") == DEAD_END_FINISH:
            choice["stop_reason"] = DEAD_END_MESSAGE
    return choices


def response_body(flavor: Flavor, request_id: str, created: int, model: str,
                  states: list[ChoiceState], prompt_tokens: int) -> dict[str, Any]:
    body = {"id": request_id, "object": flavor.object_name, "created": created,
            "model": model, "system_fingerprint": None,
            "choices": _explain_dead_ends([flavor.choice(s) for s in states]),
            "usage": usage(prompt_tokens, states)}
    if isinstance(flavor, ChatFlavor) and flavor.want_prompt_logprobs:  # vLLM: one list, top level
        body["prompt_logprobs"] = flavor.prompt_logprobs(states[0])
    return body


def chunk_body(flavor: Flavor, request_id: str, created: int, model: str,
               choices: list[dict[str, Any]],
               usage_body: dict[str, Any] | None = None) -> dict[str, Any]:
    body = {"id": request_id, "object": flavor.chunk_object, "created": created,
            "model": model, "system_fingerprint": None, "choices": _explain_dead_ends(choices)}
    if usage_body is not None:
        body["usage"] = usage_body
    return body
