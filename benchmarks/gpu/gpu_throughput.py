"""Offline throughput of a ~1.1B Llama (TinyLlama's shape, random weights) in
bfloat16 on one GPU, pdserve against transformers' `generate_batch`, and pdserve's decode step
time against the HBM bandwidth floor.

    python3 -m benchmarks.gpu.gpu_throughput --out DIR [--requests 256 --prompt-len 512 --new-tokens 256]
        [--modes graphs,eager --repeats 3 --hf-repeats 2]

pdserve runs in each --mode (graphs: CUDA graphs for decode steps and async scheduling, the
default; graphs-sync: graphs, each step waiting for its tokens; eager: the engine's enforce_eager), --repeats times each, transformers --hf-repeats times, all in one
invocation so the numbers sit side by side; medians are reported.
Each engine run is in its own process (a crashed or over-long peer cannot take the other down).
The floor of one decode step is the bytes it must read (every weight but the embedding table,
plus the K/V of every running sequence's context) divided by the device's copy bandwidth,
measured here with a 4 GiB device-to-device copy (bytes read + written per second).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048,
             tie_word_embeddings=False)


def build_model(root: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    from pdserve.models.builtin import build_byte_tokenizer
    if (root / "config.json").exists():
        return root
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **SHAPE, architectures=["LlamaForCausalLM"],
                                  bos_token_id=1, eos_token_id=2)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(root)
    build_byte_tokenizer().save_pretrained(root)  # ids past its 261 decode to nothing
    return root


def workload(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, SHAPE["vocab_size"]) for _ in range(length)] for _ in range(n)]


def copy_bandwidth(nbytes: int = 4 << 30, runs: int = 10) -> float:
    """Bytes read + written per second by a device-to-device copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()  # leave the memory to the engines' processes
    return 2 * nbytes / statistics.median(times)


def run_pdserve(args) -> dict:
    from pdserve.assembly.build import build_engine
    from pdserve.engine.config import EngineConfig
    from pdserve.protocol.sampling_params import SamplingParams
    blocks = args.requests * (-(-(args.prompt_len + args.new_tokens) // 16)) + 64
    engine = build_engine(EngineConfig(model=args.model, dtype="bfloat16", device="cuda",
                                    num_kv_blocks=blocks, max_num_seqs=args.requests,
                                    max_num_batched_tokens=args.batched_tokens,
                                    kernel_backend=args.kernel_backend,
                                    enforce_eager=args.mode.startswith("eager"),
                                    async_scheduling=not args.mode.endswith("-sync")))
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    engine.add_request("warm", workload(1, 64, seed=9)[0], SamplingParams(max_tokens=8, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    for i, p in enumerate(workload(args.requests, args.prompt_len)):
        engine.add_request(str(i), p, params)
    phases = time_overlap_phases(engine)
    produced, decode_steps = 0, []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    # No synchronize between steps: with async scheduling a step returns while the GPU runs
    # the next one, so a step's time is the wall time from one return to the next.
    while engine.has_unfinished_requests():
        running = list(engine.scheduler.running)
        s0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - s0
        produced += len(outs)
        if engine.last_step_tokens == args.requests == len(running):  # a full, pure decode step
            decode_steps.append((dt, sum(r.num_tokens for r in running)))
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    # From the cache's own layout: K and V per KV head, or MLA's one latent vector per token.
    kv_bytes_per_token = engine.kv_layout.block_nbytes(1)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in engine.model.named_parameters()
                       if "embed_tokens" not in n)
    return dict(output_tokens=produced, seconds=elapsed, tokens_per_s=produced / elapsed,
                decode_steps=decode_steps, kv_bytes_per_token=kv_bytes_per_token,
                weight_bytes=weight_bytes, kernel_backend=args.kernel_backend, mode=args.mode,
                overlap_phases_ms={k: statistics.median(v) * 1e3 for k, v in phases.items() if v})


def time_overlap_phases(engine) -> dict[str, list[float]]:
    """Wraps the overlapped step's parts to time them on the host, per step: schedule, launch
    (inputs, graph replay, device argmax), wait (for the step before's tokens), settle (stops,
    detokenization) and commit (KV commit, pending tokens)."""
    from pdserve.engine import overlap
    phases: dict[str, list[float]] = {"schedule": [], "launch": [], "wait": [], "settle": [], "commit": []}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            phases[name].append(time.perf_counter() - t0)
            return out
        return wrapper

    def collect(engine_, step):
        t0 = time.perf_counter()
        if step.copied is not None:
            step.copied.synchronize()
        t1 = time.perf_counter()
        out = original_collect(engine_, step)
        phases["wait"].append(t1 - t0)
        phases["settle"].append(time.perf_counter() - t1)
        return out

    original_collect = overlap.collect
    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    overlap.launch = timed("launch", overlap.launch)
    overlap.after_launch = timed("commit", overlap.after_launch)
    overlap.collect = collect
    return phases


def run_transformers(args) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16,
                                                 attn_implementation="paged|sdpa").cuda().eval()
    config = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1,
                              pad_token_id=0)
    prompts = workload(args.requests, args.prompt_len)
    with torch.no_grad():
        model.generate_batch(inputs=prompts[:4], generation_config=config, progress_bar=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    produced = sum(len(r.generated_tokens) for r in out.values())
    return dict(output_tokens=produced, seconds=elapsed, tokens_per_s=produced / elapsed)


def in_subprocess(args, engine: str, timeout_s: float) -> dict:
    cmd = [sys.executable, "-m", __spec__.name, "--worker", engine, "--model", args.model,
           "--requests", str(args.requests), "--prompt-len", str(args.prompt_len),
           "--new-tokens", str(args.new_tokens), "--batched-tokens", str(args.batched_tokens),
           "--kernel-backend", args.kernel_backend, "--mode", args.mode]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return {"error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-3000:]}
    return json.loads(lines[-1])


def decode_summary(pd: dict, bandwidth: float) -> dict:
    """The median full pure-decode step, with its own context, against the HBM floor."""
    steps = pd.get("decode_steps") or []
    if not steps:
        return {}
    dt, ctx = sorted(steps)[len(steps) // 2]
    floor_bytes = pd["weight_bytes"] + ctx * pd["kv_bytes_per_token"]
    return dict(median_step_ms=dt * 1e3, context_tokens=ctx, bytes_read=floor_bytes,
                floor_ms=floor_bytes / bandwidth * 1e3, ratio_to_floor=dt / (floor_bytes / bandwidth),
                steps=len(steps))


def summarize_runs(runs: list[dict], bandwidth: float) -> dict:
    """Medians over repeated runs of one engine (tokens/s; decode step and its floor ratio)."""
    good = [r for r in runs if "tokens_per_s" in r]
    if not good:
        return {"errors": runs}
    out = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in good),
           "tokens_per_s_runs": [r["tokens_per_s"] for r in good],
           "output_tokens": good[0]["output_tokens"], "failed_runs": len(runs) - len(good),
           "overlap_phases_ms_runs": [r.get("overlap_phases_ms") for r in good]}
    decodes = [decode_summary(r, bandwidth) for r in good if r.get("decode_steps")]
    if decodes:
        by_step = sorted(decodes, key=lambda d: d["median_step_ms"])
        out["decode"] = by_step[len(by_step) // 2]  # the median run's median step
        out["decode"]["median_step_ms_runs"] = [d["median_step_ms"] for d in decodes]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--model", default=None, help="default: build the 1.1B model under --out")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batched-tokens", type=int, default=8192)
    ap.add_argument("--kernel-backend", default="triton")
    ap.add_argument("--timeout-s", type=float, default=240)
    ap.add_argument("--modes", default="graphs,graphs-sync,eager",
                    help="graphs: CUDA graphs with async scheduling; graphs-sync: without it; eager")
    ap.add_argument("--mode", default="graphs", help=argparse.SUPPRESS)  # one worker's mode
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf-repeats", type=int, default=2, help="0 skips transformers")
    ap.add_argument("--worker", choices=["pdserve", "transformers"], default=None)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps((run_pdserve if args.worker == "pdserve" else run_transformers)(args)))
        return
    args.model = args.model or str(build_model(Path("/tmp/pdserve-llama-1b")))
    bandwidth = copy_bandwidth()
    result = {"copy_bandwidth_gbps": bandwidth / 1e9}
    for mode in args.modes.split(","):
        args.mode = mode
        runs = [in_subprocess(args, "pdserve", args.timeout_s) for _ in range(args.repeats)]
        result[f"pdserve_{mode}"] = summarize_runs(runs, bandwidth)
    if args.hf_repeats:
        runs = [in_subprocess(args, "transformers", args.timeout_s) for _ in range(args.hf_repeats)]
        result["transformers"] = summarize_runs(runs, bandwidth)
        for mode in args.modes.split(","):
            pd = result[f"pdserve_{mode}"]
            if "tokens_per_s" in pd and "tokens_per_s" in result["transformers"]:
                pd["vs_transformers"] = pd["tokens_per_s"] / result["transformers"]["tokens_per_s"]
    result["workload"] = dict(requests=args.requests, prompt_len=args.prompt_len,
                              new_tokens=args.new_tokens, shape=SHAPE)
    Path(args.out, "throughput.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
