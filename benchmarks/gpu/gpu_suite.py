"""The GPU path, measured on one GPU. One command runs every step and writes JSON.

    python3 -m benchmarks.gpu.gpu_suite --out DIR [--steps env,kernels,exact,served,throughput,nixl,pd]
    python3 -m benchmarks.gpu.gpu_suite --out DIR --steps quant

Steps (each writes DIR/<step>.json; a failing step records its error and the rest still run):
  env         torch/CUDA/Triton/NIXL versions, the GPU, flash-attn presence
  kernels     tests/test_kernels.py on CUDA: every backend (Triton compiled, torch) vs float64
  exact       offline engine vs transformers' greedy generate, same device and dtype, for the
              correctness suite's models in float32 and bfloat16; bfloat16 reports the first
              divergence and the reference's top-2 logit gap there
  served      the same through `pdserve up` 1P1D over NIXL (VRAM to VRAM)
  throughput  benchmarks/gpu/gpu_throughput.py (1.1B Llama, bf16, 256 x 512 -> 256)
  nixl        benchmarks/kv_transfer/bench_nixl.py --device cuda (two processes, VRAM to VRAM READs)
  pd          benchmarks/serving/bench_serving.py, 1P1D over NIXL vs monolithic on the 1.1B model
  quant       benchmarks/gpu/gpu_quant.py: quantized-kernel tests, greedy exactness per format,
              the 1.1B decode step and throughput in bf16, FP8 per channel, FP8 blocks, W4A16
              (about 8 minutes; not in the default steps)
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from benchmarks.gpu.gpu_throughput import build_model
from benchmarks.support.cluster import local_cluster

ROOT = Path(__file__).resolve().parents[2]  # the repository: the benchmarks run from there as modules
RAW = Path("/tmp/pdserve-gpu-raw")  # logs and raw files; only the step JSONs go to --out
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PROMPT_LENGTHS = (7, 45, 160)
NEW_TOKENS = 48


def step_env(args) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0),
            "capability": list(torch.cuda.get_device_capability(0)),
            "gpu_memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30}
    for mod in ("triton", "transformers", "flash_attn", "nixl", "zmq", "fastapi"):
        try:
            info[mod] = getattr(__import__(mod), "__version__", "present")
        except Exception as exc:  # noqa: BLE001 - recorded, not fatal
            info[mod] = f"missing: {exc!r}"[:200]
    return info


def step_kernels(args) -> dict:
    xml = RAW / "kernels.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(ROOT / "tests/test_kernels.py"), f"--junitxml={xml}"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    return {"returncode": proc.returncode, "summary": proc.stdout.strip().splitlines()[-1:],
            "failures": [ln for ln in proc.stdout.splitlines() if ln.startswith("FAILED")][:40]}


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab - 5) for _ in range(n)] for n in PROMPT_LENGTHS]


def reference_greedy(path: Path, dtype: torch.dtype, prompts) -> list[tuple[list[int], list]]:
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype,
                                               attn_implementation="sdpa").cuda().eval()
    ref.generation_config.eos_token_id = None
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            g = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
            out.append((g.sequences[0, len(p):].tolist(), [step[0].float().cpu() for step in g.logits]))
    del ref
    return out


def compare(got: list[int], want: list[int], logits) -> dict:
    """Exact, or where the first divergence is and how close the reference's top-2 were."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            top2 = logits[i].topk(2)
            return {"exact": False, "first_divergence": i, "got": g, "want": w,
                    "top2_gap": float(top2.values[0] - top2.values[1]),
                    "got_is_reference_second_choice": int(top2.indices[1]) == g}
    return {"exact": len(got) == len(want), "first_divergence": None}


def _free_gpu() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def step_exact(args) -> dict:
    from pdserve import LLM, SamplingParams
    from pdserve.testing.model_factory import ARCHS, make_model
    root = Path(tempfile.mkdtemp())
    results = []
    for kind in ARCHS:
        path = make_model(root, kind)
        for dname, dtype in DTYPES.items():
            prompts = _prompts(261)
            refs = reference_greedy(path, dtype, prompts)
            for backend in ("triton", "torch"):
                llm = LLM(model=str(path), dtype=dname, device="cuda", kernel_backend=backend,
                          num_kv_blocks=256)
                params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                for p, o, (want, logits) in zip(prompts, outs, refs):
                    results.append({"model": kind, "dtype": dname, "backend": backend,
                                    "prompt_len": len(p),
                                    **compare(o.outputs[0].token_ids, want, logits)})
                del llm
                _free_gpu()
    return _tally(results)


def _tally(results: list[dict]) -> dict:
    by: dict[str, dict] = {}
    for r in results:
        key = f"{r['dtype']}/{r.get('backend', 'served')}"
        t = by.setdefault(key, {"sequences": 0, "exact": 0, "min_top2_gap_at_divergence": None})
        t["sequences"] += 1
        t["exact"] += r["exact"]
        if not r["exact"] and r.get("top2_gap") is not None:
            prev = t["min_top2_gap_at_divergence"]
            t["max_top2_gap_at_divergence"] = max(t.get("max_top2_gap_at_divergence", 0), r["top2_gap"])
            t["min_top2_gap_at_divergence"] = r["top2_gap"] if prev is None else min(prev, r["top2_gap"])
    return {"by_dtype_backend": by, "sequences": results}


def step_served(args) -> dict:
    import httpx

    from pdserve.testing.model_factory import make_model
    path = make_model(Path(tempfile.mkdtemp()), "llama")
    prompts = _prompts(261)
    results = []
    for dname, dtype in DTYPES.items():
        refs = reference_greedy(path, dtype, prompts)
        _free_gpu()
        flags = ("--model", str(path), "--prefill-nodes", "1", "--decode-nodes", "1",
                 "--kv-transfer", "nixl", "--dtype", dname, "--num-kv-blocks", "256")
        with local_cluster(*flags, startup_timeout_s=300) as c:
            health = httpx.get(f"{c.url}/health", timeout=10).json()
            model_id = httpx.get(f"{c.url}/v1/models", timeout=10).json()["data"][0]["id"]
            for p, (want, logits) in zip(prompts, refs):
                body = {"model": model_id, "prompt": p, "max_tokens": NEW_TOKENS, "temperature": 0,
                        "ignore_eos": True, "return_token_ids": True}
                r = httpx.post(f"{c.url}/v1/completions", json=body, timeout=120).json()
                got = r["choices"][0]["token_ids"]
                results.append({"model": "llama", "dtype": dname, "prompt_len": len(p),
                                **compare(got, want, logits)})
            after = httpx.get(f"{c.url}/health", timeout=10).json()
        results.append({"dtype": dname, "health_before": health, "health_after": after,
                        "exact": True, "note": "node counters, not a sequence"})
    out = _tally([r for r in results if "note" not in r])
    out["health"] = [r for r in results if "note" in r]
    return out


def step_throughput(args) -> dict:
    subprocess.run([sys.executable, "-m", "benchmarks.gpu.gpu_throughput", "--out", str(RAW)],
                   check=True, timeout=1200, cwd=ROOT)
    return json.loads((RAW / "throughput.json").read_text())


def step_nixl(args) -> dict:
    js = RAW / "nixl.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.kv_transfer.bench_nixl", "--device", "cuda",
                           "--configs", args.nixl_configs, "--total-mib", "256", "--block-kib", "512",
                           "--json", str(js)], capture_output=True, text=True, timeout=400, cwd=ROOT)
    out = json.loads(js.read_text()) if js.exists() else {}
    out.update(returncode=proc.returncode, table=proc.stdout[-4000:], stderr=proc.stderr[-3000:])
    return out


def step_pd(args) -> dict:
    model = build_model(Path("/tmp/pdserve-llama-1b"))
    js = RAW / "pd.json"
    cmd = [sys.executable, "-m", "benchmarks.serving.bench_serving", "--model", str(model),
           "--configs", "pd-nixl", "monolithic", "--workloads", "random", "--repeats", "2",
           "--num-prompts", "128", "--concurrency", "32", "--input-len-min", "256",
           "--input-len-max", "1024", "--output-len", "128", "--min-token-id", "3",  # the router checks ids against the byte tokenizer
           "--max-token-id", "258", "--warmup-prompts", "8", "--up-flag=--kv-cache-memory-gb=12",
           "--output-json", str(js)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    out = json.loads(js.read_text()) if js.exists() else {}
    return {"returncode": proc.returncode, "tables": proc.stdout[-6000:],
            "stderr": proc.stderr[-3000:], "summary": out.get("summary", out)}


def step_quant(args) -> dict:
    from benchmarks.gpu import gpu_quant
    out = RAW / "quant"
    out.mkdir(parents=True, exist_ok=True)
    return gpu_quant.run(gpu_quant.parse_args(["--out", str(out)]))


STEPS = {"env": step_env, "kernels": step_kernels, "exact": step_exact, "served": step_served,
         "throughput": step_throughput, "nixl": step_nixl, "pd": step_pd, "quant": step_quant}
DEFAULT_STEPS = [name for name in STEPS if name != "quant"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", default=",".join(DEFAULT_STEPS))
    ap.add_argument("--nixl-configs", default="0,4,5", help="bench_nixl.py CONFIGS indices")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    RAW.mkdir(parents=True, exist_ok=True)
    for name in args.steps.split(","):
        t0 = time.monotonic()
        try:
            result = STEPS[name](args)
        except BaseException as exc:  # noqa: BLE001 - one step's failure must not lose the others
            result = {"error": repr(exc), "traceback": traceback.format_exc()[-4000:]}
        result["step_seconds"] = round(time.monotonic() - t0, 1)
        Path(args.out, f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
        print(f"== {name} ({result['step_seconds']} s)", json.dumps(result, default=str)[:1500], flush=True)


if __name__ == "__main__":
    main()
