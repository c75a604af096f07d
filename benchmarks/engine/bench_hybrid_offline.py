"""Offline throughput on hybrid models (random weights): pdserve beside transformers' own
`generate` on the same checkpoint, in one run.

Three shapes, each a scaled-down copy of its family's proportions:
- Qwen3.5 (`qwen3_5_text`, 35M): hidden 512, 8 layers (three Gated DeltaNet layers before each
  gated full-attention layer), linear attention with 4 key and 8 value heads of 64, attention
  with 8 heads of 64 (2 KV heads, a quarter of each rotary), MLP 1536, vocab 8192.
- Nemotron-H (`nemotron_h`, 20M): hidden 512, 8 blocks (Mamba2, MLP, Mamba2, MLP, attention,
  MLP, Mamba2, MLP), Mamba2 with 16 heads of 64, state 64, 2 groups, chunk 128; squared-ReLU
  MLP 1536, vocab 8192.
- Falcon-H1 (`falcon_h1`): hidden 512, 8 layers, each Mamba2 (16 heads of 64, state 64, 2 groups,
  chunk 128) beside attention (as above, full rotary), then a SwiGLU MLP 1536, vocab 8192; the
  muP multipliers left at 1 (they cost the same at any value).

Workload: 32 requests of 32-256 prompt tokens, 32 new tokens each, ignore_eos, float32 on CPU
(`--dtype bfloat16`: pdserve's products in bf16, `--cpu-gemm-dtype bfloat16`, beside
transformers' model loaded in bf16).
transformers runs one left-padded `generate` over all requests, with its torch paths for the
linear layers (the chunked delta rule and SSD scan for the prompt, the one-token update after;
flash-linear-attention, causal-conv1d and mamba-ssm are CUDA packages). Greedy outputs are
compared request by request.

Each run reports output tokens per wall-clock second and per second of the process's CPU time:
on a shared machine whose other jobs stop or starve this one, the second is the steadier figure,
and one thread (`--threads 1`, `NUMBA_NUM_THREADS=1`) keeps spinning threads out of it.

    NUMBA_NUM_THREADS=1 .venv/bin/python -m benchmarks.engine.bench_hybrid_offline --repeats 3 --threads 1
    NUMBA_NUM_THREADS=1 .venv/bin/python -m benchmarks.engine.bench_hybrid_offline --repeats 3 --threads 1 --dtype bfloat16
    .venv/bin/python -m benchmarks.engine.bench_hybrid_offline --repeats 3
    NUMBA_NUM_THREADS=1 .venv/bin/python -m benchmarks.engine.bench_hybrid_offline --family nemotron_h --profile --threads 1
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

from benchmarks.engine.offline_cpu_shares import cpu_shares
from benchmarks.engine.offline_model_bench import build_model, workload

_ATTENTION = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=64, hidden_size=512, intermediate_size=1536,
                  vocab_size=8192, max_position_embeddings=2048, tie_word_embeddings=False, initializer_range=0.2)
FAMILIES = {
    "qwen3_5_text": ("Qwen3_5ForCausalLM", dict(
        _ATTENTION, num_hidden_layers=8, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64)),
    "nemotron_h": ("NemotronHForCausalLM", dict(
        _ATTENTION, layers_block_type=["linear_attention", "mlp", "linear_attention", "mlp", "full_attention",
                                       "mlp", "linear_attention", "mlp"],
        mamba_num_heads=16, mamba_head_dim=64, ssm_state_size=64, n_groups=2, chunk_size=128, conv_kernel=4)),
    "falcon_h1": ("FalconH1ForCausalLM", dict(
        _ATTENTION, num_hidden_layers=8, mamba_d_ssm=1024, mamba_n_heads=16, mamba_d_head=64, mamba_n_groups=2,
        mamba_d_state=64, mamba_chunk_size=128, mamba_d_conv=4)),
}
# What --profile times, beside the engine step and model forward (offline_cpu_shares.py)
HYBRID_PARTS = [
    ("pdserve.models.gated_deltanet", "GatedDeltaNet", "forward", "  Gated DeltaNet layers"),
    ("pdserve.models.gated_deltanet", "GatedDeltaNet", "_convolve", "    their convolution"),
    ("pdserve.models.gated_deltanet", "GatedDeltaNet", "_mix", "    their delta rule"),
    ("pdserve.models.mamba2_mixer", "Mamba2Mixer", "forward", "  Mamba2 layers"),
    ("pdserve.models.mamba2_mixer", "Mamba2Mixer", "_convolve", "    their convolution"),
    ("pdserve.models.mamba2_mixer", "Mamba2Mixer", "_scan", "    their scan"),
    ("pdserve.engine.model_runner", "AttentionContext", "attention", "  attention kernels"),
    ("pdserve.layers.quant.unquantized", "FloatLinear", "forward", "  the projections (FloatLinear)"),
    ("torch.nn", "Linear", "forward", "  nn.Linear (LM head)"),
]


class Timed(NamedTuple):
    """One timed generate: output tokens per wall-clock second and per second of the process's
    CPU time (which a process stopped or starved by other jobs does not count), and the tokens."""
    wall: float
    cpu: float
    tokens: list[list[int]]


@contextlib.contextmanager
def clocks(out: dict):
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    out["wall"], out["cpu"] = time.perf_counter() - wall, time.process_time() - cpu


def run_pdserve(path: Path, prompts, new_tokens: int, dtype: str = "float32") -> Timed:
    """One greedy offline generate over all prompts (after a short warm-up generate); dtype: the
    products' (cpu_gemm_dtype: bfloat16 for a prefill's or a batch's many rows)."""
    from pdserve import LLM, SamplingParams
    llm = LLM(model=str(path), num_kv_blocks=1024, max_num_batched_tokens=2048, cpu_gemm_dtype=dtype)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:32]}], params, use_tqdm=False)
    spent: dict = {}
    with clocks(spent):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    n = len(prompts) * new_tokens
    return Timed(n / spent["wall"], n / spent["cpu"], [o.outputs[0].token_ids for o in outs])


def run_transformers(path: Path, prompts, new_tokens: int, dtype: str = "float32") -> Timed:
    """One left-padded greedy generate over all prompts, the model in dtype."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="sdpa",
                                                 dtype=getattr(torch, dtype)).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    spent: dict = {}
    with clocks(spent), torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    n = len(prompts) * new_tokens
    return Timed(n / spent["wall"], n / spent["cpu"], out[:, width:].tolist())


def bench_family(family: str, args: argparse.Namespace, root: Path) -> str:
    """The family's runs, alternated; returns its table row."""
    arch, config = FAMILIES[family]
    path, params = build_model(root / family, family, arch, config)
    prompts = workload(args.requests, *args.prompt_tokens, config["vocab_size"])
    if args.profile:
        shares = cpu_shares(path, prompts, args.new_tokens, HYBRID_PARTS)
        for label, seconds in shares:
            print(f"{label:44s} {seconds:6.2f} s CPU {100 * seconds / shares[0][1]:5.1f}%")
        return ""
    ours, theirs, agree = [], [], []
    for r in range(args.repeats):  # alternated, so both see the same machine
        ours.append(run_pdserve(path, prompts, args.new_tokens, args.dtype))
        theirs.append(run_transformers(path, prompts, args.new_tokens, args.dtype))
        agree.append(sum(a == b for a, b in zip(ours[-1].tokens, theirs[-1].tokens)))
        print(f"{family} run {r + 1}: pdserve {ours[-1].wall:.1f} tok/s ({ours[-1].cpu:.1f} per CPU s), "
              f"transformers {theirs[-1].wall:.1f} tok/s ({theirs[-1].cpu:.1f} per CPU s), "
              f"same greedy tokens on {agree[-1]}/{len(prompts)} requests", flush=True)
    cells = []
    for clock in ("wall", "cpu"):
        a, b = (statistics.median(getattr(t, clock) for t in runs) for runs in (ours, theirs))
        runs = " / ".join(", ".join(f"{getattr(t, clock):.0f}" for t in side) for side in (ours, theirs))
        cells.append(f"{a:.1f} / {b:.1f} = **{a / b:.2f}x** ({runs})")
    return f"| {family} ({params / 1e6:.0f}M) | {' | '.join(cells)} | {min(agree)}/{len(prompts)} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=[*FAMILIES, "all"], default="all")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(32, 256), metavar=("LO", "HI"),
                        help="each prompt's length is drawn from LO..HI")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads for both engines (0: torch's default, one per core)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="bfloat16: pdserve's products in bf16 (--cpu-gemm-dtype bfloat16), transformers' "
                             "model in bf16")
    parser.add_argument("--profile", action="store_true",
                        help="instead: pdserve's CPU seconds per part of the model, one run")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    families = list(FAMILIES) if args.family == "all" else [args.family]
    with tempfile.TemporaryDirectory() as tmp:
        rows = [bench_family(f, args, Path(tmp)) for f in families]
    if args.profile:
        return
    print(f"\n{args.requests} requests of {args.prompt_tokens[0]}-{args.prompt_tokens[1]} prompt tokens x {args.new_tokens} new tokens; "
          f"{torch.get_num_threads()} torch threads; {args.dtype}; medians of {args.repeats} "
          "(the runs: pdserve's / transformers')")
    print("| model | output tokens/s: pdserve / transformers | per CPU second: pdserve / transformers "
          "| identical greedy outputs |")
    print("|---|---|---|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
