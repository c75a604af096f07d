"""SmolLM2-135M-Instruct (the default model) offline with an FP8 KV cache against a float32 one:
the prompt logprobs' difference and the greedy tokens' agreement over pdserve/testing/smollm2.py's 16
prompts and 64 new tokens each. An accuracy report, not a timing. Run:

    .venv/bin/python -m benchmarks.engine.bench_fp8_kv_accuracy
"""
from __future__ import annotations

from pdserve import LLM, SamplingParams
from pdserve.models.gguf import DEFAULT_MODEL
from pdserve.testing.smollm2 import NEW_TOKENS, PROMPTS


def run(kv_cache_dtype: str):
    llm = LLM(DEFAULT_MODEL, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=256)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, prompt_logprobs=0)
    return llm.generate(PROMPTS, params, use_tqdm=False)


def main() -> None:
    full, fp8 = run("auto"), run("fp8")
    diffs, prefix, identical = [], 0, 0
    for a, b in zip(full, fp8):
        diffs += [abs(x.logprob - y.logprob) for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])]
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        prefix += next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        identical += ta == tb
    print(f"prompt logprobs, |fp8 - float32 KV|: max {max(diffs):.4f}, mean {sum(diffs) / len(diffs):.4f} nats "
          f"over {len(diffs)} tokens")
    print(f"greedy: {identical}/{len(PROMPTS)} outputs identical; tokens before the first difference "
          f"{prefix}/{len(PROMPTS) * NEW_TOKENS}")


if __name__ == "__main__":
    main()
