"""SmolLM2-135M-Instruct's Q4_1 GGUF: pdserve keeping it quantized against transformers loading
the same file dequantized to float32. Greedy, 16 chat prompts x 64 new tokens; prints the token
agreement and, where a sequence differs, the reference's top-2 logit gap at the first difference.

    PYTHONPATH=. .venv/bin/python benchmarks/smollm2_gguf_exactness.py [--prompts 16] [--tokens 64]
"""
from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM

from pdserve import LLM, SamplingParams
from pdserve.models.gguf import DEFAULT_MODEL, embedded_model_file

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly.",
             "List three prime numbers.", "Who wrote Hamlet?", "What is 12 times 7?",
             "Give me a tip for learning Python.", "Describe a cat in one sentence.", "Why is the sky blue?",
             "Name a famous painter.", "What does a CPU do?", "Translate 'good morning' to Spanish.",
             "Tell me a fun fact about octopuses.", "What is the boiling point of water?",
             "Suggest a name for a dog.", "How many days are in a leap year?"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    file = embedded_model_file(DEFAULT_MODEL)
    llm = LLM(DEFAULT_MODEL, num_kv_blocks=512)
    tok = llm.engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in QUESTIONS[:args.prompts]]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    ref = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32).eval()
    same_tokens = total = identical = 0
    for prompt, got in zip(prompts, ours):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens,
                               do_sample=False, eos_token_id=None, pad_token_id=0,
                               output_scores=True, return_dict_in_generate=True)
        want = out.sequences[0, len(prompt):].tolist()
        agree = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
        same_tokens += agree
        total += len(want)
        identical += agree == len(want)
        if agree < len(want):
            top2 = out.scores[agree][0].topk(2).values
            print(f"differs at token {agree}: top-2 gap {float(top2[0] - top2[1]):.4f}")
    print(f"identical sequences {identical}/{len(prompts)}; tokens before the first difference "
          f"{same_tokens}/{total}")


if __name__ == "__main__":
    main()
