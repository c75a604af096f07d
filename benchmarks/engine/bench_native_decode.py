"""The compiled decode step (pdserve/kernels/native_decode.c: a step's layers in one C call) beside
the same engine running the layers in Python, offline, on the default model (SmolLM2-135M's Q4_1
GGUF, kept quantized), in one run.

    .venv/bin/python -m benchmarks.engine.bench_native_decode [--batches 1 8 32] [--threads 2] [--lora-rank 8]
        [--tp 2] [--family llama|qwen2|qwen3|gemma3|qwen3_moe|gpt_oss|deepseek_v3] [--mxfp4]

--family runs a random-weight float32 checkpoint of that family at a real small model's layer
shapes instead (llama: SmolLM2-135M's, qwen2: Qwen2.5-0.5B's, qwen3: Qwen3-0.6B's, gemma3: Gemma 3
270M's, qwen3_moe: bench_moe_offline.py's Qwen3-MoE of 32 experts, top 4, gpt_oss: gpt-oss-20b's
proportions scaled down alike, deepseek_v3: bench_mla_offline.py's), with the test
models' byte-level vocabulary, so the LM head (Python in both modes) costs little. With --mxfp4
(gpt_oss only) the experts are written as gpt-oss ships them, MXFP4, and both modes keep them so.

For each batch size, requests with 128-token prompts decode --steps steps; the median engine step
(sampling included) is taken for each mode, the two modes alternating within each of --repeats
rounds (the machine is shared). Prints the medians over rounds and the ratio Python / compiled.
With --lora-rank, every request runs under one random PEFT adapter of that rank on every
projection (both modes add its deltas). With --tp 2 the engine runs two ranks (--threads split
between them); the Python-layers mode turns the compiled step off on the driver only, whose
step the worker's then waits for at every all-reduce, so the figure is the driver's Python
layers (the worker's C step hidden behind them).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def random_adapter(base: Path, out: Path, rank: int) -> Path:
    """A PEFT adapter of the model at base, rank `rank` on every projection (only its shapes
    matter here), made on a randomly initialised model of base's config."""
    import transformers  # heavy: only with --lora-rank

    from pdserve.testing.lora_adapters import adapter_of
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(base))
    return adapter_of(model, out, seed=0, r=rank, alpha=2 * rank)


# the layer shapes of SmolLM2-135M, Qwen2.5-0.5B, Qwen3-0.6B, Gemma 3 270M, and scaled-down MoE models
FAMILY_SHAPES = {
    "llama": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3),
    "qwen2": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2),
    "qwen3": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128),
    "gemma3": dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
                   num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
                   layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3),
    # benchmarks/engine/bench_moe_offline.py's: Qwen3-30B-A3B's proportions, scaled down
    "qwen3_moe": dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_experts=32,
                      num_experts_per_tok=4, num_hidden_layers=7, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=64),
    # benchmarks/engine/bench_mla_offline.py's DeepSeek-V3: latent attention, 32 experts in 4 groups
    "deepseek_v3": dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, n_routed_experts=32,
                        num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
                        num_hidden_layers=7, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=192,
                        kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64),
    # gpt-oss-20b's proportions, scaled down as the Qwen3-MoE above (its 64 heads to 8, 32 experts)
    "gpt_oss": dict(hidden_size=512, intermediate_size=256, num_local_experts=32, num_experts_per_tok=4,
                    num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2, head_dim=64, sliding_window=128,
                    layer_types=["sliding_attention", "full_attention"] * 3),
}


def model_under_test(family: str | None, root: Path, mxfp4: bool = False) -> tuple[str, str, dict]:
    """(path, its name in the table, LLM options): the default GGUF, or a float32 family model
    (with MXFP4 experts: gpt_oss with mxfp4)."""
    from pdserve.models.gguf import DEFAULT_MODEL
    if family is None:
        return DEFAULT_MODEL, "SmolLM2-135M Q4_1", {}
    from pdserve.testing.model_factory import make_deepseek, make_model
    make = make_deepseek if family.startswith("deepseek") else make_model
    path = make(root, family, max_position_embeddings=4096, **FAMILY_SHAPES[family])
    name = f"{family} float32 ({FAMILY_SHAPES[family]['num_hidden_layers']} layers)"
    if mxfp4:
        from pdserve.testing.quant_checkpoints import write_mxfp4
        path, name = write_mxfp4(path), name.replace("float32", "float32, MXFP4 experts")
    return str(path), name, {"dtype": "float32"}


def decode_steps(llm, batch: int, steps: int, seed: int, adapter: str | None = None) -> float:
    """The median seconds of an engine step while `batch` requests decode (prefill excluded)."""
    from pdserve import SamplingParams
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    vocab = engine.model.spec.vocab_size
    for i in range(batch):
        start = 1000 + 997 * (seed * batch + i) % 20000
        prompt = [(start + j) % (vocab - 3) + 3 for j in range(128)]  # within the vocabulary (--family: byte-level)
        engine.add_request(f"r{seed}-{i}", prompt, params, lora_name=adapter)
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])  # after the prefill steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lora-rank", type=int, default=0, help="every request under an adapter of this rank (0: none)")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    ap.add_argument("--family", choices=sorted(FAMILY_SHAPES), default=None)
    ap.add_argument("--mxfp4", action="store_true", help="gpt_oss: its experts in MXFP4, as gpt-oss ships them")
    args = ap.parse_args()
    if args.mxfp4 and args.family != "gpt_oss":
        raise SystemExit("--mxfp4 goes with --family gpt_oss")
    os.environ.update(OMP_NUM_THREADS=str(args.threads), NUMBA_NUM_THREADS=str(args.threads))
    import torch

    from pdserve import LLM
    from pdserve.models.model_path import resolve_model_path
    torch.set_num_threads(args.threads)
    lora = dict(enable_lora=True, max_lora_rank=args.lora_rank) if args.lora_rank else {}
    root = tempfile.TemporaryDirectory()
    path, name, options = model_under_test(args.family, Path(root.name), args.mxfp4)
    llm = LLM(path, num_kv_blocks=1024, enable_prefix_caching=False, tensor_parallel_size=args.tp, **lora, **options)
    adapter = None
    if args.lora_rank:
        with tempfile.TemporaryDirectory() as tmp:  # read whole by add_lora
            adapter = "bench"
            llm.engine.add_lora(adapter, str(random_adapter(resolve_model_path(path), Path(tmp), args.lora_rank)))
    model = llm.engine.model
    native = model.native_decode
    if native is None:
        raise SystemExit("the compiled decode step is off on this machine (see the log line above)")
    decode_steps(llm, 1, 4, seed=99, adapter=adapter)  # warm up both paths
    model.native_decode = None
    decode_steps(llm, 1, 4, seed=98, adapter=adapter)
    print(f"{name}{f', LoRA rank {args.lora_rank}' if adapter else ''}, TP {args.tp}, {args.threads} threads, "
          f"{args.steps} decode steps, medians of {args.repeats} rounds")
    print(f"{'batch':>5} {'python layers ms':>17} {'compiled ms':>12} {'python / compiled':>18}")
    for batch in args.batches:
        timings = {"python": [], "compiled": []}
        for r in range(args.repeats):
            for mode in ("compiled", "python") if r % 2 else ("python", "compiled"):
                model.native_decode = native if mode == "compiled" else None
                timings[mode].append(decode_steps(llm, batch, args.steps, seed=r, adapter=adapter))
        py, c = (statistics.median(timings[m]) for m in ("python", "compiled"))
        print(f"{batch:>5} {py * 1e3:17.2f} {c * 1e3:12.2f} {py / c:17.2f}x")
    model.native_decode = native
    llm.close()
    root.cleanup()


if __name__ == "__main__":
    main()
