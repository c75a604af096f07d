"""Cost of structured outputs and penalties per token, in a batch (offline engine, CPU).

Workload: 16 requests decoded together, 32-token prompts, up to 64 new tokens, greedy, on the
~32M-parameter Llama of support/bench_model.py with a byte-level tokenizer of the same vocabulary size
(8192 by default; --vocab 32000 for a Llama-sized one). Configurations, run alternately:
  plain           no request constrained
  json-half       8 of the 16 follow a JSON schema (the other 8 unconstrained)
  json-all        all 16 follow it
  regex-all       all 16 follow a regex
  penalties-all   all 16 with presence, frequency and repetition penalties and a logit_bias
For each: the time spent in the grammar work (bitmask fill + apply + matcher advance) or in the
logits processors, per edited token, and the engine's decode throughput; medians of --repeats.

    .venv/bin/python -m benchmarks.engine.bench_structured --repeats 5
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.support.bench_model import CONFIG

SCHEMA = {"type": "object", "required": ["name", "age", "tags", "note"], "additionalProperties": False,
          "properties": {"name": {"enum": ["ada", "bob", "cy"]}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "note": {"type": "string"}}}
REGEX = r"[a-z]+( [a-z]+)*\."
BATCH, PROMPT_LEN, NEW_TOKENS = 16, 32, 64


def build_tokenizer(vocab_size: int):
    """Byte-level Unigram: the 256 byte symbols plus random 2-6 character pieces of them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(0)
    pieces = list(alphabet)
    seen = set(pieces)
    while len(pieces) < vocab_size - 1:
        piece = "".join(rng.choice(alphabet[:96]) for _ in range(rng.randint(2, 6)))
        if piece not in seen:
            seen.add(piece)
            pieces.append(piece)
    core = Tokenizer(models.Unigram([(p, -float(len(p) == 1)) for p in pieces]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(["</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>")


def build_model(root: Path, vocab_size: int) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig
    tokenizer = build_tokenizer(vocab_size)
    torch.manual_seed(0)
    config = LlamaConfig(**{**CONFIG, "vocab_size": len(tokenizer)}, eos_token_id=tokenizer.eos_token_id,
                         architectures=["LlamaForCausalLM"])
    AutoModelForCausalLM.from_config(config).save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


class Timer:
    """Wraps a function and adds up the seconds spent in it."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def params_for(config: str, row: int):
    from pdserve import SamplingParams
    from pdserve.protocol.sampling_params import StructuredSpec
    base = dict(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    if config.startswith("json") and (config == "json-all" or row % 2 == 0):
        return SamplingParams(**base, structured=StructuredSpec("json", json.dumps(SCHEMA)))
    if config == "regex-all":
        return SamplingParams(**base, structured=StructuredSpec("regex", REGEX))
    if config == "penalties-all":
        return SamplingParams(**base, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                              logit_bias={7: 2.0, 11: -5.0})
    return SamplingParams(**base)


def run_once(llm, config: str, prompts: list[list[int]]) -> dict:
    import pdserve.engine.engine as engine_module
    engine = llm.engine
    fill, accept = Timer(engine.structured.apply_bitmask), Timer(engine.structured.accept)
    processors = Timer(engine_module.apply_logits_processors)
    engine.structured.apply_bitmask, engine.structured.accept = fill, accept
    engine_module.apply_logits_processors = processors
    try:
        params = [params_for(config, i) for i in range(len(prompts))]
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        del engine.structured.apply_bitmask, engine.structured.accept
        engine_module.apply_logits_processors = processors.fn
    tokens = [len(o.outputs[0].token_ids) for o in outs]
    edited = sum(t for t, p in zip(tokens, params) if p.structured is not None or p.has_logits_processors)
    extra = fill.seconds + accept.seconds if "penalties" not in config else processors.seconds
    return {"tok_s": sum(tokens) / elapsed, "us_per_edited_token": 1e6 * extra / edited if edited else 0.0,
            "share": extra / elapsed, "edited_tokens": edited, "tokens": sum(tokens)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=CONFIG["vocab_size"])
    args = parser.parse_args()
    from pdserve import LLM
    configs = ["plain", "json-half", "json-all", "regex-all", "penalties-all"]
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(build_model(Path(tmp), args.vocab)), num_kv_blocks=1024)
        rng = random.Random(1)
        prompts = [[rng.randrange(300, args.vocab - 1) for _ in range(PROMPT_LEN)] for _ in range(BATCH)]
        for config in configs:  # warm-up: compiles each grammar once (cached afterwards)
            run_once(llm, config, prompts[:2])
        runs = {c: [] for c in configs}
        for _ in range(args.repeats):
            for config in configs:
                runs[config].append(run_once(llm, config, prompts))
    # tok/s is not like for like across configs: constrained rows end at different lengths
    # (the batch thins out); the share of run time spent on the edits is.
    print(f"vocab {args.vocab}, batch {BATCH}, up to {NEW_TOKENS} new tokens, medians of {args.repeats}")
    print(f"{'config':<15} {'tok/s':>8} {'us/edited token':>16} {'share of time':>14} {'edited/total':>13}")
    for config, rs in runs.items():
        tok_s = statistics.median(r["tok_s"] for r in rs)
        us = statistics.median(r["us_per_edited_token"] for r in rs)
        share = statistics.median(r["share"] for r in rs)
        print(f"{config:<15} {tok_s:8.1f} {us:16.1f} {100 * share:13.1f}% "
              f"{rs[0]['edited_tokens']:>6}/{rs[0]['tokens']}")


if __name__ == "__main__":
    main()
