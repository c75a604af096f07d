"""How far the formats that quantize activations move a real model: SmolLM2-135M-Instruct (the
default model, its Q4_1 GGUF dequantized to float32 by transformers) saved as float32, then
quantized round-to-nearest (no calibration) to compressed-tensors FP8 per channel, FP8 128x128
blocks and W8A8, and to FP8 blocks in DeepSeek's / Qwen3's `quant_method: fp8` format, with the
tests' own writers (pdserve.testing.quant_checkpoints). Each runs offline in pdserve against the
float32 checkpoint: greedy outputs identical, and tokens before the first difference, over
pdserve/testing/smollm2.py's first --prompts prompts and --tokens new tokens each; and the
next-token argmax at every prompt position. An accuracy report, not a timing. Run:

    .venv/bin/python -m benchmarks.engine.bench_act_quant_agreement --prompts 16 --tokens 64
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from pdserve import LLM, SamplingParams
from pdserve.testing.quant_checkpoints import write_act_quant, write_fp8
from pdserve.testing.smollm2 import load_reference

WRITERS = {
    "compressed-tensors W8A8": lambda root, src: write_act_quant(root, src, "W8A8"),
    "compressed-tensors FP8 per channel": lambda root, src: write_act_quant(root, src, "FP8_DYNAMIC"),
    "compressed-tensors FP8 blocks": lambda root, src: write_act_quant(root, src, "FP8_BLOCK"),
    "quant_method fp8 blocks": lambda root, src: write_fp8(src, _mkdir(root / "blocks"))[0],
}


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


def compare(path: Path, baseline: list, prompts: list[list[int]], base_llm: LLM, tokens: int) -> str:
    llm = LLM(str(path), num_kv_blocks=512)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]
    identical = sum(a == b for a, b in zip(outs, baseline))
    prefix = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(outs, baseline))
    top1 = sum((llm.engine.prompt_logits(p).argmax(-1) == base_llm.engine.prompt_logits(p).argmax(-1)).sum().item()
               for p in prompts)
    positions = sum(len(p) for p in prompts)
    return (f"{identical}/{len(prompts)} outputs identical, {prefix}/{len(prompts) * tokens} tokens before the "
            f"first difference, prompt argmax equal at {top1}/{positions} positions")


def save_float32(model, path: Path) -> None:
    """transformers will not save a model it loaded from a GGUF: the same weights in a plain one."""
    from transformers import AutoModelForCausalLM
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    ref = load_reference()
    prompts = ref.prompt_ids()[:args.prompts]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        src = root / "float32"
        save_float32(ref.model, src)
        ref.tokenizer.save_pretrained(src)
        base_llm = LLM(str(src), num_kv_blocks=512)
        params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
        baseline = [o.outputs[0].token_ids for o in base_llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        for name, write in WRITERS.items():
            print(f"{name}: {compare(write(root, src), baseline, prompts, base_llm, args.tokens)}", flush=True)


if __name__ == "__main__":
    main()
