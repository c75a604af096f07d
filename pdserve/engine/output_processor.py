"""Incremental detokenization and stop conditions (EOS, stop ids, stop strings, lengths)."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.request import Request, RequestStatus


@dataclass
class DetokenizerState:
    text: str = ""          # text of the output so far
    emitted: int = 0        # characters of `text` already sent to the client
    prefix_offset: int = 0  # tokens before read_offset decoded only for context
    read_offset: int = 0
    stopped_by_string: bool = False


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.states: dict[str, DetokenizerState] = {}

    def add(self, request_id: str, output_token_ids: list[int] = ()) -> None:
        """Track a request; output_token_ids were drawn (and sent) elsewhere already."""
        state = DetokenizerState(read_offset=len(output_token_ids))
        if output_token_ids and self.tokenizer is not None:
            state.text = self.tokenizer.decode(list(output_token_ids), skip_special_tokens=True)
            state.emitted = len(state.text)
        self.states[request_id] = state

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def check_stop(self, req: Request) -> RequestStatus | None:
        """Status the request ends with after its newest token, or None to go on."""
        params, token = req.sampling_params, req.output_token_ids[-1]
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def new_text(self, req: Request, finished: bool) -> tuple[str, bool]:
        """Text to send for the newest token, and whether a stop string ended the request."""
        state = self.states[req.request_id]
        if self.tokenizer is None:
            return "", False
        token = req.output_token_ids[-1]
        params = req.sampling_params
        hide = finished and token in self.eos_token_ids | set(params.stop_token_ids)
        if not hide:
            state.text += self._decode_step(req, state, finished)
        stop_hit = self._apply_stop_strings(state, params)
        finished = finished or stop_hit
        # Hold back a tail that could be the start of a stop string until we know.
        hold = 0 if finished else max((len(s) for s in params.stop), default=1) - 1
        end = max(len(state.text) - hold, state.emitted)
        chunk, state.emitted = state.text[state.emitted:end], end
        return chunk, stop_hit

    def _decode_step(self, req: Request, state: DetokenizerState, finished: bool) -> str:
        ids = req.output_token_ids
        prefix = self.tokenizer.decode(ids[state.prefix_offset:state.read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(ids[state.prefix_offset:], skip_special_tokens=True)
        if full.endswith("\ufffd") and not finished:
            return ""  # an incomplete UTF-8 sequence: wait for the next byte token
        state.prefix_offset, state.read_offset = state.read_offset, len(ids)
        return full[len(prefix):]

    @staticmethod
    def _apply_stop_strings(state: DetokenizerState, params) -> bool:
        if not params.stop:
            return False
        window_start = max(state.emitted - max(len(s) for s in params.stop), 0)
        for stop in params.stop:
            at = state.text.find(stop, window_start)
            if at >= 0:
                cut = at + len(stop) if params.include_stop_str_in_output else at
                state.text = state.text[:cut]
                state.emitted = min(state.emitted, cut)
                return True
        return False
