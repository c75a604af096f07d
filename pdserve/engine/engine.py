"""The engine core: add requests, step, get per-request token deltas. Both node kinds and the
offline LLM run on this; it imports no server code."""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence

import torch

from pdserve.engine.logits_processors import apply_logits_processors
from pdserve.engine.overlap import InFlightStep, overlapped_step
from pdserve.engine.parts import EngineParts
from pdserve.engine.pipelined import LaunchedBatch, pipelined_step
from pdserve.engine.prompt_logprobs import take_prompt_logprobs
from pdserve.engine.request import RemoteKV, Request, RequestStatus
from pdserve.engine.sampler import sample
from pdserve.engine.speculation import Speculation
from pdserve.protocol.block_keys import request_salt
from pdserve.protocol.multimodal import ImageInput
from pdserve.protocol.outputs import StepOutput
from pdserve.protocol.sampling_params import SamplingParams

# Steps of at least this many tokens are prefill-bound; their time per token is the node's
# prefill cost, averaged with this weight on the newest sample.
COST_SAMPLE_MIN_TOKENS = 64
COST_EMA_WEIGHT = 0.2


class LLMEngine:
    """Implements SpeculationHost (pdserve.engine.speculation). Built by pdserve.assembly."""

    def __init__(self, parts: EngineParts):
        self.config = parts.config
        self.device, self.dtype = parts.device, parts.dtype
        self.model_path, self.hf_config = parts.model_path, parts.hf_config
        self.kv_layout, self.salt = parts.kv_layout, parts.salt
        self.model, self.kv_cache, self.executor = parts.model, parts.kv_cache, parts.executor
        self.tokenizer = parts.tokenizer
        self.max_model_len = parts.max_model_len
        self.pool, self.kv, self.lora, self.scheduler = parts.pool, parts.kv, parts.lora, parts.scheduler
        self.runner = parts.runner
        self.outputs, self.structured = parts.outputs, parts.structured
        self.async_scheduling = parts.async_scheduling
        self.speculator: Speculation | None = None  # see attach_speculator
        self.last_step_tokens = 0
        self.prefill_s_per_token = 0.0  # measured on prefill-sized steps (an EMA); 0: not yet
        self._cost_warmed = False  # the first prefill-sized step is no sample (_record_step_cost)
        self.cached_prompt_tokens = 0    # prompt tokens of requests sampled here that were not computed
        self.computed_prompt_tokens = 0  # ... and that were
        self.in_flight: InFlightStep | None = None  # with async scheduling: the step launched last
        # With pipeline stages: the steps launched and not yet collected (pdserve.engine.pipelined)
        self.launched: deque[LaunchedBatch] = deque()
        self.last_collected_at = 0.0
        self.scheduler.steps_in_flight = getattr(self.runner, "steps_in_flight", 1)

    def attach_speculator(self, speculator: Speculation) -> None:
        """Speculative decoding (pdserve.assembly attaches it before the first request). It needs
        each step's tokens on the host to draft the next: no async scheduling with it."""
        if self.async_scheduling:
            raise ValueError("speculative decoding runs without async scheduling")
        self.speculator = speculator
        self.scheduler.steps_in_flight = 1  # (and so one pipeline step at a time: drafts need the tokens)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (they also stop when this process ends)."""
        if self.executor is not None:
            self.executor.close()

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    output_token_ids: list[int] | None = None, remote_kv_tokens: int = 0,
                    hold_blocks: bool = False, continues_elsewhere: bool = False,
                    cache_salt: str | None = None, lora_name: str | None = None,
                    images: Sequence[ImageInput] = (), first_token_pending: bool = False) -> Request:
        """Queue a request. output_token_ids continues a generation (tokens drawn elsewhere);
        remote_kv_tokens > 0 admits it in WAITING_FOR_REMOTE_KVS with blocks for that many
        tokens allocated (see Request.block_ids), until report_remote_kv is called.
        hold_blocks keeps the blocks after the request finishes, until release_blocks.
        continues_elsewhere: a prefill node's request, which another node continues.
        cache_salt, lora_name: enter its block keys' salt (request_salt), so it shares cached
        blocks only with requests that name the same ones. lora_name: the LoRA adapter that
        computes it (one registered with add_lora or lora_modules).
        images: a vision-language model's images, their placeholders already in the prompt
        (pdserve.protocol.multimodal); their keys enter the block keys.
        first_token_pending: the request's first token is drawn elsewhere, with the KV (a push
        handover): blocks for every prompt token are allocated now, and it waits, past any
        deadline, until continue_remote brings the token."""
        self._validate(request_id, prompt_token_ids, params)
        for name, value in (("cache_salt", cache_salt), ("lora_name", lora_name)):
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"{name} must be a non-empty string")
        self._check_lora_name(lora_name)
        req = Request(request_id, list(prompt_token_ids), params, hold_blocks=hold_blocks,
                      cache_salt=cache_salt, lora_name=lora_name, salt=self.request_salt(cache_salt, lora_name))
        if images:
            self._attach_images(req, images)
        for token in output_token_ids or []:
            req.append_output(token)
        if params.structured is not None:  # replays the tokens drawn elsewhere; ValueError if off-grammar
            req.matcher = self.structured.new_matcher(params.structured, req.output_token_ids)
        self.outputs.add(request_id, params, req.output_token_ids, continues_elsewhere)
        if lora_name is not None:
            self.lora.ref(lora_name)  # (checked above: cannot fail)
        if remote_kv_tokens > 0 and (params.prompt_logprobs is None or req.output_token_ids):
            # (A request still owing prompt logprobs computes its prompt: they need its logits.)
            remote = (RemoteKV(min(remote_kv_tokens, req.num_tokens), math.inf) if first_token_pending else
                      RemoteKV(min(remote_kv_tokens, req.num_tokens - 1),
                               time.monotonic() + self.config.remote_kv_timeout_s))
            self.scheduler.add_remote(req, remote)
        else:
            self.scheduler.add(req)
        return req

    def _attach_images(self, req: Request, images: Sequence[ImageInput]) -> None:
        mm = self.runner.multimodal
        if mm is None:
            raise ValueError(f"the model {self.config.model} does not take images")
        req.images = tuple(images)
        mm.prepare(req)  # ValueError when the placeholders and the images disagree

    @property
    def encoder_stats(self):
        """A vision-language model's encoder-cache counters (EncoderStats); None for text."""
        mm = self.runner.multimodal
        return mm.cache.stats if mm is not None else None

    def request_salt(self, cache_salt: str | None = None, lora_name: str | None = None) -> bytes:
        """The block-key salt of a request naming these: the engine's layout salt mixed with them."""
        return request_salt(self.salt, cache_salt, lora_name)

    # ---- LoRA adapters (pdserve.lora) ------------------------------------------------------
    def add_lora(self, name: str, path: str) -> None:
        """Register a PEFT adapter directory under `name` (ValueError if unusable)."""
        self._lora_manager().add(name, path)

    def remove_lora(self, name: str) -> bool:
        """Unregister an adapter: new requests cannot name it; those that do already finish."""
        return self._lora_manager().remove(name)

    def list_loras(self) -> list[str]:
        return self.lora.names() if self.lora is not None else []

    def _lora_manager(self):
        if self.lora is None:
            raise ValueError("LoRA adapters are off: start with enable_lora (--lora-modules or --max-loras)")
        return self.lora

    def _check_lora_name(self, lora_name: str | None) -> None:
        if lora_name is not None and lora_name not in self._lora_manager().paths:
            raise ValueError(f"unknown LoRA adapter {lora_name!r}")

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if request_id in self.scheduler.requests or request_id in self.scheduler.held:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt)} tokens; this model accepts at most "
                             f"{self.max_model_len - 1} so one token can be generated")
        vocab = self.model.spec.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        biased = list(params.logit_bias) + [t for w in params.bad_words_token_ids for t in w]
        if biased and (min(biased) < 0 or max(biased) >= vocab):
            raise ValueError(f"logit_bias and bad word token ids must be in [0, {vocab})")

    def report_remote_kv(self, request_id: str, ok: bool, cached_tokens: int = 0) -> None:
        """The remote KV of a WAITING_FOR_REMOTE_KVS request landed whole (ok) or failed. A prefix
        loaded rather than computed here (from the store, or lent by a decode node) gives
        cached_tokens: the prompt's first cached_tokens count as cached (usage's cached_tokens)."""
        req = self.scheduler.requests.get(request_id)
        if req is None or req.remote_kv is None:
            return
        req.remote_kv.landed, req.remote_kv.failed, req.remote_kv.in_flight = ok, not ok, False
        if ok:
            req.num_cached_tokens = max(req.num_cached_tokens, cached_tokens)

    def continue_remote(self, request_id: str, output_token_ids: list[int]) -> Request | None:
        """A first_token_pending request's first token(s), drawn elsewhere: replayed as
        add_request replays them; its KV deadline starts now. None if it is gone."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return None
        for token in output_token_ids:
            req.append_output(token)
        self.outputs.replay(request_id, req.sampling_params, output_token_ids)
        if req.remote_kv is not None:
            req.remote_kv.num_tokens = min(req.remote_kv.num_tokens, req.num_tokens - 1)
            req.remote_kv.deadline = time.monotonic() + self.config.remote_kv_timeout_s
        return req

    def cache_landed_kv(self, request_id: str) -> None:
        """The remote KV of a request about to be aborted landed whole: enter its full blocks
        into the prefix cache, so freeing the request leaves them cached (as a finished
        request's are). The router credited this node with the prompt when it sent it here."""
        req = self.scheduler.requests.get(request_id)
        if req is None or req.remote_kv is None:
            return
        full = req.remote_kv.num_tokens // self.config.block_size * self.config.block_size
        req.num_computed_tokens = max(req.num_computed_tokens, full)
        # A hybrid model's landed state is the state after all remote tokens: a snapshot of the
        # last full block only where they end on it.
        self.kv.commit(req, snapshot=full == req.remote_kv.num_tokens)

    def mark_remote_transfer(self, request_id: str) -> None:
        """A transfer into the request's blocks has started: hold it past its deadline until
        report_remote_kv says how the transfer ended."""
        req = self.scheduler.requests.get(request_id)
        if req is not None and req.remote_kv is not None:
            req.remote_kv.in_flight = True

    def release_blocks(self, request_id: str) -> bool:
        """Free the blocks a finished hold_blocks request kept for its handover."""
        return self.scheduler.release_held(request_id)

    def abort_request(self, request_id: str) -> bool:
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return self.scheduler.release_held(request_id)
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        self.outputs.remove(request_id)
        if self.speculator is not None:
            self.speculator.release(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None or bool(self.launched)

    def get_request(self, request_id: str) -> Request | None:
        return self.scheduler.requests.get(request_id)

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [T, vocab] at every prompt position (a reference hook for tests and tools)."""
        req = Request("__prompt_logits__", list(token_ids), SamplingParams())
        if not self.kv.allocate(req, len(token_ids)):
            raise MemoryError("not enough free KV blocks")
        try:
            meta_items = [(req, len(token_ids))]
            return self.runner.execute(meta_items, all_logits=True)[0]
        finally:
            self.kv.free(req)

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One step; returns the token deltas it produced. With async scheduling the deltas of
        a pure decode step come out of the next call, while the step after it computes."""
        if self.async_scheduling:
            return overlapped_step(self)
        if self.scheduler.steps_in_flight > 1:
            return pipelined_step(self)
        batch = self.scheduler.schedule()
        self.last_step_tokens = batch.num_tokens
        return self.run_batch(batch)

    def run_batch(self, batch) -> list[StepOutput]:
        """Runs a scheduled batch and waits for its tokens."""
        if not batch.items:
            return []
        if self.speculator is not None:
            self.speculator.add_drafts(batch)
        t0 = time.perf_counter()
        logits, to_sample = self.runner.execute(batch.items)
        return self.finish_batch(batch, logits, to_sample, t0)

    def finish_batch(self, batch, logits: torch.Tensor, to_sample: list[Request], started: float
                     ) -> list[StepOutput]:
        """A batch's logits are in: its cost, its committed blocks, its tokens drawn. A request
        that ended while its step was in flight (pipelined steps) is passed over."""
        if batch.num_tokens >= COST_SAMPLE_MIN_TOKENS:
            if self.device.type == "cuda":  # kernels run asynchronously: time them, not their launch
                torch.cuda.synchronize(self.device)
            self._record_step_cost(time.perf_counter() - started, batch.num_tokens)
        drafted = self.speculator.take_drafts(batch) if self.speculator is not None else {}
        for req, n in batch.items:
            if req.request_id not in drafted and not req.status.is_finished:  # (drafted: commits what it accepted)
                req.num_computed_tokens += n
                self.kv.commit(req)
        if any(r.status.is_finished for r in to_sample):
            keep = [i for i, r in enumerate(to_sample) if not r.status.is_finished]
            logits, to_sample = logits[keep], [to_sample[i] for i in keep]
        if not to_sample:
            return []
        if drafted:
            return self._verify(logits, to_sample, drafted)
        params = [r.sampling_params for r in to_sample]
        self._process_logits(logits, to_sample)
        tokens, logprobs = sample(logits, params, [r.num_output_tokens for r in to_sample])
        return [self.advance(req, tok, lp) for req, tok, lp in zip(to_sample, tokens, logprobs)]

    def _verify(self, logits: torch.Tensor, to_sample: list[Request], drafted: dict[str, list[int]]
                ) -> list[StepOutput]:
        """A step with drafts: a drafted request has a row at its last token and one per draft,
        each sampled as the output position it stands for (pdserve.spec_decode.verify)."""
        spans = [len(drafted.get(r.request_id, ())) + 1 for r in to_sample]
        rows = [r for r, n in zip(to_sample, spans) for _ in range(n)]
        positions = [r.num_output_tokens + i for r, n in zip(to_sample, spans) for i in range(n)]
        self._process_logits(logits, rows)  # (drafted requests have no edits: their rows stay)
        tokens, logprobs = sample(logits, [r.sampling_params for r in rows], positions)
        outs, row = [], 0
        for req, n in zip(to_sample, spans):
            if n == 1:
                outs.append(self.advance(req, tokens[row], logprobs[row]))
            else:
                outs.append(self.speculator.advance(req, drafted[req.request_id], tokens[row:row + n],
                                                    logprobs[row:row + n]))
            row += n
        return outs

    @torch.inference_mode()  # the logits are inference tensors: edit them in place in that mode
    def _process_logits(self, logits: torch.Tensor, to_sample: list[Request]) -> None:
        """Per-request edits (penalties, biases, grammars); rows without any are untouched."""
        apply_logits_processors(logits, to_sample, self.outputs.eos_token_ids)
        self.structured.apply_bitmask(logits, [r.matcher for r in to_sample])

    def _record_step_cost(self, seconds: float, num_tokens: int) -> None:
        """Routers weigh prefill nodes by this cost per prompt token (their TTFT estimate). The
        first prefill-sized step pays one-time costs (a prefill node, not warmed up at start,
        compiles or loads its kernels there): as the EMA's first sample it made a compose demo's
        prefill node look 50 ms a token for its next dozen prompts, and the router prefilled them
        on the decode nodes instead."""
        if not self._cost_warmed:
            self._cost_warmed = True
            return
        sample = seconds / num_tokens
        ema = self.prefill_s_per_token
        self.prefill_s_per_token = sample if ema == 0 else ema + COST_EMA_WEIGHT * (sample - ema)

    def advance(self, req: Request, token: int, logprob) -> StepOutput:
        """A request's newly drawn token appended: its stops, text and step output."""
        if not req.output_token_ids:  # its prompt was prefilled here
            self.cached_prompt_tokens += req.num_cached_tokens
            self.computed_prompt_tokens += req.num_prompt_tokens - req.num_cached_tokens
        req.append_output(token)
        return self.settle(req, token, logprob)

    def settle(self, req: Request, token: int, logprob) -> StepOutput:
        """Stops, text and the step's output for a request whose newest token is `token`."""
        prompt_logprobs = take_prompt_logprobs(req)
        status = self.outputs.check_stop(req)
        if req.matcher is not None and self.structured.accept(req.matcher, token) and status is None:
            status = RequestStatus.FINISHED_STOPPED  # the grammar is complete
        text, stopped_by_string = self.outputs.new_text(req, status is not None)
        if stopped_by_string:
            status = RequestStatus.FINISHED_STOPPED
        out = StepOutput(req.request_id, [token], text, status is not None,
                         status.finish_reason if status else None,
                         [logprob] if logprob is not None else None,
                         req.num_prompt_tokens, req.num_cached_tokens, prompt_logprobs=prompt_logprobs)
        if status is not None and req.matcher is not None:  # a grammar's dead end is no plain "stop"
            out.finish_reason = self.structured.finish_reason(req.matcher, out.finish_reason)
        if status is not None:
            self.scheduler.finish(req, status)
            self.outputs.remove(req.request_id)
            if self.speculator is not None:
                self.speculator.release(req.request_id)
        return out
