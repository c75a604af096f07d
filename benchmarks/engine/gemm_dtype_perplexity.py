"""What each --cpu-gemm-dtype costs in accuracy: the default model's perplexity over three fixed
texts (English prose twice, Python once), teacher-forced through prompt logprobs, per setting.

    .venv/bin/python -m benchmarks.engine.gemm_dtype_perplexity [--settings float32,bfloat16,int8]

float32 is exact against transformers' float32 model; bfloat16 rounds activations and weights
to 8 significant bits per product (vLLM's CPU precision); int8 rounds activations to int8 per
block of 32 (llama.cpp's Q8 activations). A setting the CPU lacks is reported and skipped."""
from __future__ import annotations

import argparse
import math

from pdserve import LLM, SamplingParams
from pdserve.kernels.dequant_tiles import resolve_gemm_dtype
from pdserve.models.gguf import DEFAULT_MODEL

TEXTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg developed a "
    "system of movable metal type in Mainz. Before his invention, books were copied by hand, a slow and expensive "
    "process that limited the spread of knowledge. Gutenberg's press made it possible to produce many copies of a "
    "text quickly, and within a few decades printing shops had appeared in cities across Europe. The effects were "
    "profound: literacy rose, scientific ideas circulated faster, and religious debates reached a wider audience "
    "than ever before.",
    "Photosynthesis is the process by which green plants, algae and some bacteria convert light energy into "
    "chemical energy. In the chloroplasts of plant cells, chlorophyll absorbs sunlight, and this energy drives the "
    "splitting of water molecules into oxygen, protons and electrons. The electrons pass along a transport chain "
    "that produces ATP and NADPH, which the Calvin cycle then uses to fix carbon dioxide into sugars. The oxygen "
    "released as a by-product is the source of nearly all the oxygen in Earth's atmosphere.",
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n    middle = len(items) // 2\n"
    "    left = merge_sort(items[:middle])\n    right = merge_sort(items[middle:])\n    merged = []\n"
    "    i = j = 0\n    while i < len(left) and j < len(right):\n        if left[i] <= right[j]:\n"
    "            merged.append(left[i])\n            i += 1\n        else:\n            merged.append(right[j])\n"
    "            j += 1\n    merged.extend(left[i:])\n    merged.extend(right[j:])\n    return merged\n",
]


def perplexity(setting: str, model: str) -> tuple[float, int]:
    llm = LLM(model, cpu_gemm_dtype=setting, enable_prefix_caching=False)
    outputs = llm.generate(TEXTS, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False)
    logprobs = [lp.logprob for out in outputs for lp in (out.prompt_logprobs or []) if lp is not None]
    return math.exp(-sum(logprobs) / len(logprobs)), len(logprobs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--settings", default="float32,bfloat16,int8")
    args = p.parse_args()
    print("| --cpu-gemm-dtype | tokens | perplexity |\n|---|---:|---:|")
    for setting in args.settings.split(","):
        try:
            resolve_gemm_dtype(setting)
        except ValueError as e:
            print(f"| {setting} | | not on this CPU: {e} |")
            continue
        value, tokens = perplexity(setting, args.model)
        print(f"| {setting} | {tokens} | {value:.4f} |")


if __name__ == "__main__":
    main()
