"""The offline API, vLLM-shaped: LLM(model=...).generate(prompts, sampling_params)."""
from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm.auto import tqdm

from pdserve.assembly.build import build_engine
from pdserve.engine.config import EngineConfig
from pdserve.lora.request import LoRARequest
from pdserve.models.image_prompts import ImagePrompts
from pdserve.offline.beam_search import run_beam_search
from pdserve.protocol.beam_search import BeamSearchOutput, BeamSearchParams
from pdserve.protocol.cache_salt import check_cache_salt
from pdserve.protocol.outputs import CompletionOutput, RequestOutput
from pdserve.protocol.sampling_params import SamplingParams

PromptType = str | dict


class LLM:
    def __init__(self, model: str = "builtin:tiny", **engine_options):
        self.engine = build_engine(EngineConfig(model=model, **engine_options))
        self._ids = itertools.count()
        # A vision-language model's image processor and placeholder expansion; None for text.
        self.image_prompts = ImagePrompts.for_model(self.engine.model_path, self.engine.hf_config.multimodal_config) \
            if getattr(self.engine.hf_config, "multimodal_config", None) is not None else None

    def close(self) -> None:
        """Stop the engine's tensor-parallel workers now rather than at exit."""
        self.engine.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """lora_request: the adapter of every prompt, or one per prompt (None: the base model);
        an adapter not registered yet is registered from its path."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        adapters = self._adapters(lora_request, len(prompts))
        results = {}
        for prompt, p, adapter in zip(prompts, params, adapters):
            rid = str(next(self._ids))
            text, token_ids = self._tokenize(prompt)
            token_ids, images = self._with_images(prompt, token_ids)
            self.engine.add_request(rid, token_ids, p, cache_salt=_cache_salt(prompt), lora_name=adapter,
                                    images=images)
            results[rid] = _Collector(text, token_ids)
        self._run(results, use_tqdm and len(prompts) > 1)
        return [c.to_output(rid) for rid, c in results.items()]

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request: LoRARequest | None = None, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's offline beam search, with transformers' rules (pdserve.protocol.beam_search):
        per prompt, the beam_width best hypotheses, best first. Text prompts only (no images)."""
        del use_tqdm  # (vLLM's argument; the rounds are short)
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        adapter = self._adapters(lora_request, 1)[0]
        tokenized = []
        for prompt in prompts:
            if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
                raise ValueError("beam search takes text prompts only")
            tokenized.append((self._tokenize(prompt)[1], _cache_salt(prompt)))
        return run_beam_search(self.engine, tokenized, params, lora_name=adapter)

    def _adapters(self, lora_request, count: int) -> list[str | None]:
        requests = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * count
        if len(requests) != count:
            raise ValueError(f"got {count} prompts but {len(requests)} LoRA requests")
        for lr in {lr for lr in requests if lr is not None}:
            self.engine.add_lora(lr.lora_name, lr.lora_path)
        return [lr.lora_name if lr is not None else None for lr in requests]

    def _run(self, results: dict, use_tqdm: bool) -> None:
        bar = tqdm(total=len(results), desc="Generating", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    results[out.request_id].add(out)
                    bar.update(int(out.finished))
        except BaseException:
            for rid in results:
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()

    def _with_images(self, prompt: PromptType, token_ids: list[int]) -> tuple[list[int], list]:
        """A dict prompt's multi_modal_data {"image": a PIL image or a list of them}, as vLLM
        takes it: the prompt with each image placeholder expanded, and the images' inputs."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if not data:
            return token_ids, []
        if set(data) - {"image"}:
            raise ValueError(f"multi_modal_data takes only 'image', got {sorted(data)}")
        if self.image_prompts is None:
            raise ValueError(f"the model {self.engine.config.model} does not take images")
        pictures = data["image"] if isinstance(data["image"], (list, tuple)) else [data["image"]]
        return self.image_prompts.expand(token_ids, pictures)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if not isinstance(prompt.get("prompt"), str):
                raise ValueError("a dict prompt needs 'prompt_token_ids' or a 'prompt' text")
            prompt = prompt["prompt"]
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer; pass {'prompt_token_ids': [...]} instead")
        return prompt, tokenizer(prompt)["input_ids"]


def _cache_salt(prompt: PromptType) -> str | None:
    """A dict prompt's cache_salt (as vLLM takes it): its blocks are shared only with prompts
    that carry the same salt."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    check_cache_salt(salt)
    return salt


class _Collector:
    def __init__(self, prompt: str | None, prompt_token_ids: list[int]):
        self.prompt, self.prompt_token_ids = prompt, prompt_token_ids
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list | None = None
        self.finish_reason = None
        self.num_cached_tokens = 0
        self.prompt_logprobs = None

    def add(self, out) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.token_ids += out.new_token_ids
        self.text += out.new_text
        if out.new_logprobs is not None:
            self.logprobs = (self.logprobs or []) + out.new_logprobs
        self.finish_reason = out.finish_reason
        self.num_cached_tokens = out.num_cached_tokens

    def to_output(self, rid: str) -> RequestOutput:
        completion = CompletionOutput(0, self.text, self.token_ids, self.finish_reason, self.logprobs)
        return RequestOutput(rid, self.prompt, self.prompt_token_ids, [completion],
                             num_cached_tokens=self.num_cached_tokens, prompt_logprobs=self.prompt_logprobs)
