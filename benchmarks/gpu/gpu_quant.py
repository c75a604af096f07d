"""Quantized weights on one GPU: kernel tests, greedy exactness per format, and the 1.1B model's
decode step and offline throughput in bf16, FP8 per channel, FP8 blocks and W4A16.

    python3 -m benchmarks.gpu.gpu_quant --out DIR [--parts kernels,exact,decode] [--formats ...]
    python3 -m benchmarks.gpu.gpu_suite --out DIR --steps quant     # the same, as a suite step

Parts (each writes DIR/quant_<part>.json):
  kernels  tests/test_triton_quant*.py on CUDA (Triton compiled, torch._scaled_mm row-wise), and
           the quantized MoE models' logits on CUDA against their CPU kernels
  exact    the correctness suite's small Llama in float32, each quantized format: greedy tokens on
           CUDA (the Triton / _scaled_mm path) against pdserve on CPU (the CPU kernels, which CI
           checks against the dequantized model and transformers)
  decode   the 1.1B Llama (gpu_throughput's shape) per format, one engine process each, batches
           of --batches requests (prompt --prompt-len, --new-tokens each): median full decode step
           against its HBM floor (weights as stored + the batch's K/V, over the measured copy
           bandwidth), and output tokens/s; the largest batch is the offline throughput
Sized for about 8 minutes on an H100; the quantized 1.1B checkpoints are written once (CPU work)
under --model-root and reused.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("kernels", "exact", "decode")
NEW_TOKENS = 32


def parse_args(argv=None) -> argparse.Namespace:
    from benchmarks.gpu.gpu_quant_checkpoints import FORMATS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--model-root", default="/tmp/pdserve-llama-1b")
    ap.add_argument("--timeout-s", type=float, default=150, help="per engine process")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one format's engine
    args = ap.parse_args(argv)
    args.parts, args.formats = args.parts.split(","), args.formats.split(",")
    args.batches = [int(b) for b in args.batches.split(",")]
    for part in args.parts:
        if part not in PARTS:
            ap.error(f"unknown part {part!r}; parts: {', '.join(PARTS)}")
    for fmt in args.formats:
        if fmt not in FORMATS:
            ap.error(f"unknown format {fmt!r}; formats: {', '.join(FORMATS)}")
    return args


def part_kernels(args) -> dict:
    tests = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_triton_quant*.py"))
    # the quantized MoE models (DeepSeek-V3 FP8, gpt-oss MXFP4) and a GGUF mix of types on the GPU
    # against their CPU kernels
    tests += ["tests/test_fp8_blocks.py::test_the_cuda_path_gives_the_cpu_paths_logits",
              "tests/test_mxfp4.py::test_the_cuda_path_gives_the_cpu_paths_logits",
              "tests/test_gguf_quantized.py::test_the_cuda_path_gives_the_cpu_paths_logits"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    return {"returncode": proc.returncode, "summary": proc.stdout.strip().splitlines()[-1:],
            "failures": [ln for ln in proc.stdout.splitlines() if ln.startswith("FAILED")][:40],
            "output_tail": proc.stdout[-6000:] if proc.returncode else ""}


def _greedy(path: Path, device: str, prompts) -> list[list[int]]:
    from pdserve import LLM, SamplingParams
    llm = LLM(model=str(path), dtype="float32", device=device, num_kv_blocks=256)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    del llm
    return [list(o.outputs[0].token_ids) for o in outs]


def part_exact(args) -> dict:
    from benchmarks.gpu.gpu_quant_checkpoints import checkpoint
    from pdserve.testing.model_factory import make_model
    src = make_model(Path(tempfile.mkdtemp()), "llama")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (7, 45, 160)]
    results = {}
    for fmt in args.formats:
        if fmt == "bf16":
            continue
        path = checkpoint(src, fmt)
        cpu, cuda = _greedy(path, "cpu", prompts), _greedy(path, "cuda", prompts)
        firsts = [next((i for i, (a, b) in enumerate(zip(c, g)) if a != b), None) for c, g in zip(cpu, cuda)]
        results[fmt] = {"exact_vs_cpu": cpu == cuda, "sequences": len(prompts), "first_divergence": firsts,
                        "top2_gap_at_divergence": _top2_gaps(path, prompts, cpu, firsts)}
    return results


def _top2_gaps(path: Path, prompts, tokens, firsts) -> list[float | None]:
    """Where a sequence diverges, the CPU run's top-2 logit gap there over its largest |logit|:
    a near tie (activations quantized to FP8 turn float32 rounding into whole FP8 steps) or a
    real difference."""
    from pdserve import LLM
    llm, gaps = LLM(model=str(path), dtype="float32", device="cpu", num_kv_blocks=256), []
    for prompt, seq, first in zip(prompts, tokens, firsts):
        if first is None:
            gaps.append(None)
            continue
        logits = llm.engine.prompt_logits(prompt + seq[:first])[-1].float()
        top = logits.topk(2).values
        gaps.append(float((top[0] - top[1]) / logits.abs().max()))
    del llm
    return gaps


def run_worker(args) -> dict:
    """One format's engine (this process), each batch size in turn: decode steps and tokens/s."""
    import torch

    from benchmarks.gpu.gpu_throughput import workload
    from pdserve.assembly.build import build_engine
    from pdserve.engine.config import EngineConfig
    from pdserve.protocol.sampling_params import SamplingParams
    top = max(args.batches)
    blocks = top * (-(-(args.prompt_len + args.new_tokens) // 16)) + 64
    engine = build_engine(EngineConfig(model=args.worker, dtype="bfloat16", device="cuda", num_kv_blocks=blocks,
                                       max_num_seqs=top, max_num_batched_tokens=8192))
    weight_bytes = sum(p.numel() * p.element_size() for n, p in engine.model.named_parameters()
                       if "embed_tokens" not in n)
    out = {"weight_bytes": weight_bytes, "kv_bytes_per_token": engine.kv_layout.block_nbytes(1), "batches": {}}
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    for batch in [1, *args.batches]:  # the first batch of one warms up compiles and graphs
        for i, p in enumerate(workload(batch, args.prompt_len, seed=batch)):
            engine.add_request(f"{batch}-{i}", p, params)
        produced, steps = 0, []
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            running = list(engine.scheduler.running)
            s0 = time.perf_counter()
            produced += len(engine.step())
            if engine.last_step_tokens == batch == len(running):  # a full, pure decode step
                steps.append((time.perf_counter() - s0, sum(r.num_tokens for r in running)))
        torch.cuda.synchronize()
        out["batches"][str(batch)] = {"tokens_per_s": produced / (time.perf_counter() - t0), "decode_steps": steps}
    return out


def part_decode(args) -> dict:
    from benchmarks.gpu.gpu_quant_checkpoints import checkpoint
    from benchmarks.gpu.gpu_throughput import build_model, copy_bandwidth, decode_summary
    bandwidth = copy_bandwidth()
    src = build_model(Path(args.model_root))
    results = {"copy_bandwidth_gb_s": bandwidth / 1e9, "formats": {}}
    for fmt in args.formats:
        t0 = time.monotonic()
        path = checkpoint(src, fmt)
        written = time.monotonic() - t0
        run = _in_subprocess(args, path)
        per_batch = {b: {"tokens_per_s": r["tokens_per_s"],
                         **decode_summary({**run, **r}, bandwidth)} for b, r in run.get("batches", {}).items()}
        results["formats"][fmt] = {"checkpoint_seconds": round(written, 1), "weight_bytes": run.get("weight_bytes"),
                                   "batches": per_batch, **({"error": run["error"]} if "error" in run else {})}
    return results


def _in_subprocess(args, path: Path) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.gpu.gpu_quant", "--out", args.out, "--worker", str(path),
           "--batches", ",".join(map(str, args.batches)), "--prompt-len", str(args.prompt_len),
           "--new-tokens", str(args.new_tokens)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout_s:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr[-3000:]}"}
    return json.loads(lines[-1])


def run(args) -> dict:
    """Every requested part; each writes its JSON, and a failing part records its error."""
    parts = {"kernels": part_kernels, "exact": part_exact, "decode": part_decode}
    summary = {}
    for name in args.parts:
        t0 = time.monotonic()
        try:
            result = parts[name](args)
        except Exception as exc:  # noqa: BLE001 - one part's failure must not lose the others
            result = {"error": repr(exc), "traceback": traceback.format_exc()[-4000:]}
        result["seconds"] = round(time.monotonic() - t0, 1)
        Path(args.out, f"quant_{name}.json").write_text(json.dumps(result, indent=1, default=str))
        summary[name] = result
    return summary


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(args)), flush=True)
        return
    Path(args.out).mkdir(parents=True, exist_ok=True)
    print(json.dumps(run(args), default=str)[:3000], flush=True)


if __name__ == "__main__":
    main()
