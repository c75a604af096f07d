"""The decode step on GPTQ 4-bit SmolLM2-135M-Instruct beside the default model's Q4_1 GGUF, in one
run. The GPTQ checkpoints are round-to-nearest quantizations (symmetric, v1 format) of the GGUF
dequantized to float32 by transformers, written by pdserve.testing.gptq_awq_checkpoints (needs
autoawq, as the tests): groups of 128 (GPTQ's usual; SmolLM2's 576 columns are held as groups of
64) and of 32 (Q4_1's group). All are kept quantized and decode through the compiled step. The
checkpoints' float embedding (SmolLM2's tied LM head) holds the GGUF's Q8_0 values, so pdserve holds
it as Q8_0 too (gptq_awq.ExactFloatMethod); each model's line says how its LM head is held.

    .venv/bin/python -m benchmarks.engine.bench_gptq_decode [--batches 1 8] [--repeats 3]

For each batch size, requests with 128-token prompts decode --steps steps; the median engine step
(sampling included) is taken for each model, the models alternating within each of --repeats
rounds (the machine is shared). Prints the median step over rounds, and the median over rounds of
each model's step / the GGUF's step in the same round.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path


def gptq_checkpoints(root: Path) -> dict[str, Path]:
    # deferred: the imports load torch and transformers, after the thread settings in main
    from benchmarks.engine.bench_act_quant_agreement import save_float32
    from pdserve.testing.gptq_awq_checkpoints import quant_config, quantize, write_checkpoint
    from pdserve.testing.smollm2 import load_reference
    ref = load_reference()
    src = root / "float32"
    save_float32(ref.model, src)
    ref.tokenizer.save_pretrained(src)
    del ref
    paths = {}
    for group in (128, 32):
        case = dict(method="gptq", bits=4, group_size=group, sym=True, v1=True)
        tensors, packed, _ = quantize(src, case)
        paths[f"GPTQ 4-bit g{group}"] = write_checkpoint(src, root / f"gptq-g{group}", tensors, packed,
                                                         quant_config(case))
    return paths


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    os.environ.update(OMP_NUM_THREADS=str(args.threads), NUMBA_NUM_THREADS=str(args.threads))
    import torch

    from benchmarks.engine.bench_native_decode import decode_steps
    from pdserve import LLM
    from pdserve.models.gguf import DEFAULT_MODEL
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"GGUF Q4_1": DEFAULT_MODEL, **gptq_checkpoints(Path(tmp))}
        llms = {name: LLM(str(path), num_kv_blocks=1024, enable_prefix_caching=False) for name, path in paths.items()}
        for name, llm in llms.items():
            model = llm.engine.model
            head = "float32" if hasattr(model.lm_head, "weight") else f"int{model.lm_head.qweight.element_size() * 8}"
            print(f"{name}: compiled decode step {'on' if model.native_decode is not None else 'off'}, "
                  f"LM head held as {head}")
            decode_steps(llm, 1, 4, seed=99)  # warm up
        print(f"SmolLM2-135M, {args.threads} threads, {args.steps} decode steps, medians of {args.repeats} rounds")
        for batch in args.batches:
            timings: dict[str, list[float]] = {name: [] for name in llms}
            for r in range(args.repeats):
                for name in list(llms)[::-1] if r % 2 else list(llms):
                    timings[name].append(decode_steps(llms[name], batch, args.steps, seed=r))
            base = timings["GGUF Q4_1"]
            for name in llms:  # the ratio within each round (same load), then its median over rounds
                ratio = statistics.median(t / b for t, b in zip(timings[name], base))
                print(f"batch {batch:>3} {name:<16} {statistics.median(timings[name]) * 1e3:8.2f} ms  "
                      f"{ratio:5.2f}x GGUF Q4_1", flush=True)


if __name__ == "__main__":
    main()
