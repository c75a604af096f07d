"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions, run by the router.

The search (pdserve.protocol.beam_search, transformers' rules, as LLM.beam_search) advances one
token per round: each live beam is a backend request of max_tokens 1 with top logprobs, its
prompt the prompt plus the beam's tokens, so the nodes' prefix caches hold the shared prefix
once. Under P/D the first round hands the prompt over to a decode node, and the later rounds
run whole there (a DecodePin): the beams fork on the decode node. best_of (default n) is the
beam width; the best n beams are the choices. As in vLLM the answer does not stream, and the
knobs that would change the candidates (penalties, biases, stops, structured outputs, tools) or
that only sampling reads are refused rather than ignored.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.protocol.beam_search import Beam, BeamSearch, BeamSearchParams
from pdserve.protocol.outputs import StepOutput, TokenLogprob
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.router.dispatch.backend import BackendError, GenerationBackend
from pdserve.router.openai.errors import bad_request
from pdserve.router.openai.responses import ChoiceState, response_body
from pdserve.router.openai.schemas import GenerationRequest
from pdserve.router.openai.streaming import ClientDisconnected, run_until_disconnect
from pdserve.router.placement.placement import DecodePin

logger = logging.getLogger(__name__)

# Fields whose non-default values beam search would not honour: (name, default).
_REFUSED = [("presence_penalty", None), ("frequency_penalty", None), ("repetition_penalty", None),
            ("logit_bias", None), ("min_tokens", None), ("bad_words", None), ("stop", None),
            ("stop_token_ids", None), ("top_k", None), ("min_p", None), ("top_p", None), ("seed", None),
            ("prompt_logprobs", None), ("response_format", None), ("structured_outputs", None),
            ("guided_json", None), ("guided_regex", None), ("guided_choice", None), ("guided_grammar", None)]


def beam_params(body: GenerationRequest, max_tokens: int) -> BeamSearchParams:
    """The request's beam search, or a 400 naming the field it cannot take."""
    if body.stream:
        raise bad_request("use_beam_search does not stream (as in vLLM): send stream=false", "stream")
    for name, default in _REFUSED:
        if getattr(body, name, default) not in (default, [], {}):
            raise bad_request(f"{name} does not combine with use_beam_search", name)
    if getattr(body, "tools", None) and getattr(body, "tool_choice", None) != "none":
        raise bad_request("tools do not combine with use_beam_search", "tools")
    try:
        return BeamSearchParams(body.best_of or body.num_choices, max_tokens, ignore_eos=body.ignore_eos,
                                temperature=body.temperature or 0.0, length_penalty=body.length_penalty,
                                include_stop_str_in_output=body.include_stop_str_in_output,
                                early_stopping=body.early_stopping)
    except ValueError as exc:
        raise bad_request(str(exc), "temperature" if "temperature" in str(exc) else "best_of") from exc


class BeamRun:
    """One prompt's search over the backend. request_kw: backend.generate's keyword arguments
    (session, cache_salt, adapter). logprobs: top logprobs the client wants per token (None: none)."""

    def __init__(self, backend: GenerationBackend, base_id: str, prompt: list[int], params: BeamSearchParams,
                 eos: set[int], vocab_size: int, logprobs: int | None, request_kw: dict[str, Any]):
        self.backend, self.base_id, self.request_kw = backend, base_id, request_kw
        try:
            self.search = BeamSearch(prompt, params, eos, vocab_size)
        except ValueError as exc:
            raise bad_request(str(exc), "best_of") from exc
        self.logprobs = logprobs
        # (the client's top logprobs come from the same rounds: ask for the larger count)
        self.round_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                           logprobs=max(self.search.k, logprobs or 0))
        # The first round runs one token further, so that its prompt is handed over to a decode
        # node (a prefill node answers a 1-token request alone); the later rounds run whole on
        # that node (the pin), where the beams share the prompt's blocks.
        self.first_round_params = dataclasses.replace(self.round_params, max_tokens=2)
        self.pin = DecodePin()

    async def run(self) -> list[tuple[float, Beam]]:
        rounds = 0
        while not self.search.done:
            beams = self.search.running
            params = self.first_round_params if rounds == 0 and self.search.params.max_tokens > 1 else self.round_params
            tops = await asyncio.gather(*(self._one_token(f"{self.base_id}-r{rounds}b{i}", b, params)
                                          for i, b in enumerate(beams)))
            self.search.advance(list(tops))
            rounds += 1
        return self.search.results()

    async def _one_token(self, rid: str, beam: Beam, params: SamplingParams) -> list[tuple[int, float]]:
        """The top candidates for the beam's next token (the first token's; a first round's
        second token is only for its handover)."""
        finished, top = False, None
        try:
            stream = self.backend.generate(rid, self.search.prompt + beam.tokens, params, pin=self.pin,
                                           **self.request_kw)
            async for out in stream:
                if out.finish_reason == "error" or out.error:
                    raise BackendError(out.error or "generation failed")
                if top is None and out.new_logprobs:
                    top = [(int(t), float(lp)) for t, lp in out.new_logprobs[0].top]
                if out.finished:
                    finished = True
                    if top is None:
                        raise BackendError(f"{rid} finished without its logprobs")
                    return top
            raise BackendError(f"backend stream for {rid} ended before the request finished")
        finally:
            if not finished:  # cancelled (client gone) or failed: the nodes drop it too
                with anyio.CancelScope(shield=True):
                    await _abort(self.backend, rid)

    def outputs(self, n: int, tokenizer: Any, skip_special_tokens: bool) -> list[StepOutput]:
        """The best n beams as whole-choice outputs (the flavors' input)."""
        return [self._output(beam, tokenizer, skip_special_tokens) for _, beam in self.search.results()[:n]]

    def _output(self, beam: Beam, tokenizer: Any, skip_special_tokens: bool) -> StepOutput:
        search = self.search
        by_eos = bool(beam.tokens) and search.is_eos(beam.tokens[-1])
        shown = beam.tokens[:-1] if by_eos and not search.params.include_stop_str_in_output else beam.tokens
        text = tokenizer.decode(shown, skip_special_tokens=skip_special_tokens)
        lps = None
        if self.logprobs is not None:
            lps = [TokenLogprob(t, top[t], sorted(top.items(), key=lambda kv: -kv[1])[:self.logprobs])
                   for t, top in zip(beam.tokens, beam.logprobs)]
        return StepOutput(self.base_id, list(beam.tokens), text, True, "stop" if by_eos else "length", lps,
                          len(search.prompt))


async def serve_beams(router: Any, request: Request, body: GenerationRequest, job: Any, prefix: str,
                      request_kw: dict[str, Any]) -> Response:
    """Runs each prompt's search (concurrently) and answers with its best n beams as choices
    i*n .. i*n+n-1. router: the app's _Router; job: the route's GenerationJob (prompts, flavor)."""
    n = body.num_choices
    params = beam_params(body, job.params[0].max_tokens)
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    logprobs = job.params[0].logprobs
    runs = [BeamRun(router.backend, f"{request_id}-p{i}", prompt, params, router.eos_token_ids, router.vocab_size,
                    logprobs, request_kw) for i, prompt in enumerate(job.choice_prompts[::n])]
    logger.info("%s: beam search, width %d, %d prompts, max_tokens %d", request_id, params.beam_width, len(runs),
                params.max_tokens)

    async def search_all() -> None:
        await asyncio.gather(*(run.run() for run in runs))

    try:
        await run_until_disconnect(request, search_all)
    except ClientDisconnected:
        logger.info("%s: client disconnected", request_id)
        return Response(status_code=499)  # nobody reads it (the rounds were aborted)
    states = [ChoiceState(i) for i in range(len(job.choice_prompts))]
    for p, run in enumerate(runs):
        for j, out in enumerate(run.outputs(n, router.tokenizer, body.skip_special_tokens)):
            states[p * n + j].add(job.flavor.shown(out))
    model = router.served.resolve(body.model)
    answer = response_body(job.flavor, request_id, int(time.time()), model, states, job.prompt_tokens)
    return JSONResponse(answer, headers={"X-Request-Id": request_id})


async def _abort(backend: GenerationBackend, rid: str) -> None:
    try:
        await backend.abort(rid)
    except Exception:  # best effort; the node also times requests out
        logger.warning("abort of %s failed", rid, exc_info=True)
