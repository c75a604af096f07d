"""Incremental detokenization and stop conditions (EOS, stop ids, stop strings, lengths)."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.request import Request, RequestStatus


@dataclass
class DetokenizerState:
    detokenizer: IncrementalDetokenizer | None
    text: str = ""          # text of the output so far (cut at a stop string)
    emitted: int = 0        # characters of `text` already sent to the client
    stopped_by_string: bool = False
    # A prefill node's request: only its max_tokens=1 ends it here; a decode node goes on, so
    # the text it holds back (a UTF-8 or stop-string prefix) must stay held.
    continues_elsewhere: bool = False


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.states: dict[str, DetokenizerState] = {}

    def add(self, request_id: str, params, output_token_ids: list[int] = (),
            continues_elsewhere: bool = False) -> None:
        """Track a request. output_token_ids were drawn elsewhere, and their text sent from
        there: replaying them as that node did tells how much of it the client has."""
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens,
                                                 params.spaces_between_special_tokens)
        state = DetokenizerState(detokenizer, continues_elsewhere=continues_elsewhere)
        self.states[request_id] = state
        self.replay(request_id, params, output_token_ids)

    def replay(self, request_id: str, params, output_token_ids: list[int]) -> None:
        """Tokens drawn elsewhere whose text was sent from there: replayed to know how much the
        client has."""
        state = self.states[request_id]
        for token in output_token_ids if state.detokenizer is not None else ():
            self._emit(state, token, params, finished=False)

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
        if state.detokenizer is None:
            return "", False
        token, params = req.output_token_ids[-1], req.sampling_params
        if finished and state.continues_elsewhere and not self._is_stop_token(token, params):
            finished = False
        return self._emit(state, token, params, finished)

    def _is_stop_token(self, token: int, params) -> bool:
        return token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)

    def _emit(self, state: DetokenizerState, token: int, params, finished: bool) -> tuple[str, bool]:
        hide = finished and token in self.eos_token_ids | set(params.stop_token_ids)
        state.text += state.detokenizer.finish() if hide else state.detokenizer.step(token, finished)
        stop_hit = self._apply_stop_strings(state, params)
        finished = finished or stop_hit
        # Hold back a tail that could be the start of a stop string until we know.
        hold = 0 if finished else max((len(s) for s in params.stop), default=1) - 1
        end = max(len(state.text) - hold, state.emitted)
        chunk, state.emitted = state.text[state.emitted:end], end
        return chunk, stop_hit

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
