"""The MLA absorbed decode on a GPU: the Triton kernel (pdserve.kernels.mla_triton) against the
torch op (pdserve.kernels.mla_ops) and a float64 reference, at DeepSeek-V3's head shapes (128
heads, a 512 + 64 latent), paged in 16-token blocks; optionally a sweep of launch options, and
the DeepSeek engine on CUDA against transformers' generate on the CPU.

    python3 -m benchmarks.gpu.gpu_mla_decode [--sweep] [--engine]
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from pdserve.kernels import mla_ops, mla_triton

HEADS, LORA, ROPE, BLOCK = 128, 512, 64, 16
SHAPES = ((1, 4000), (16, 1500), (64, 1500), (128, 4000))  # (batch, longest context)


def case(dtype: torch.dtype, batch: int, max_len: int):
    """Random latents in shuffled blocks, context lengths in [1, max_len), absorbed queries."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    lens = torch.randint(1, max_len, (batch,), generator=g, device=dev).to(torch.int32)
    n_blocks = -(-max_len // BLOCK)
    latents = torch.randn(batch, n_blocks * BLOCK, LORA + ROPE, device=dev, generator=g).to(dtype)
    cache = torch.zeros(batch * n_blocks + 3, BLOCK, 1, LORA + ROPE, device=dev, dtype=dtype)
    tables = torch.randperm(batch * n_blocks + 3, device=dev)[:batch * n_blocks].view(batch, n_blocks)
    cache[tables.flatten()] = latents.view(-1, BLOCK, 1, LORA + ROPE)
    q = (torch.randn(batch, HEADS, LORA + ROPE, device=dev, generator=g) * 0.1).to(dtype)
    return (q, cache, LORA, tables.to(torch.int32), lens, 192 ** -0.5), latents


def reference(args, latents) -> torch.Tensor:
    q, _, value_dim, _, lens, scale = args
    out = []
    for i, n in enumerate(lens.tolist()):
        keys = latents[i, :n].double()
        out.append((torch.einsum("hd,td->ht", q[i].double(), keys) * scale).softmax(-1) @ keys[:, :value_dim])
    return torch.stack(out)


def timed_ms(fn, args, n: int = 30) -> float:
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e3


def compare(dtype: torch.dtype) -> dict:
    out = {}
    for batch, max_len in SHAPES:
        args, latents = case(dtype, batch, max_len)
        want = reference(args, latents)
        row = {}
        for name, fn in (("triton", mla_triton.paged_latent_decode), ("torch", mla_ops.paged_latent_decode)):
            err = (fn(*args).double() - want).abs().max().item()
            row[name] = {"ms": round(timed_ms(fn, args), 4), "max_abs_err": err}
        out[f"B{batch}_ctx{max_len}"] = row
        print(str(dtype), batch, max_len, json.dumps(row), flush=True)
    return out


def sweep(dtype: torch.dtype) -> dict:
    best = {}
    for batch, max_len in SHAPES[1:]:
        args, _ = case(dtype, batch, max_len)
        times = []
        for bh, bn, warps, stages, programs in itertools.product((16, 32, 64), (16, 32, 64), (4, 8), (1, 2),
                                                                 (512, 1024)):
            tuning = dict(BLOCK_H=bh, BLOCK_N=bn, num_warps=warps, num_stages=stages, programs=programs)
            try:
                times.append((timed_ms(lambda *a, t=tuning: mla_triton.paged_latent_decode(*a, tuning=t), args), tuning))
            except Exception as exc:  # noqa: BLE001 - a launch that does not compile is skipped
                print("skipped", tuning, type(exc).__name__)
        best[f"B{batch}_ctx{max_len}"] = sorted(times, key=lambda t: t[0])[:3]
        print(batch, max_len, best[f"B{batch}_ctx{max_len}"], flush=True)
    return best


def engine_check() -> dict:
    """Random-weight DeepSeek checkpoints (the tests' factory) on CUDA against transformers on CPU."""
    from pdserve import LLM, SamplingParams
    from pdserve.testing.model_factory import load_reference, make_deepseek, reference_greedy
    out, root = {}, Path("/tmp/gpu_mla_models")
    root.mkdir(exist_ok=True)
    prompts = [[(7 * i + 13 * j) % 250 for j in range(n)] for i, n in enumerate([1, 15, 40, 90, 300])]
    for kind in ("deepseek_v3", "deepseek_v2"):
        path = make_deepseek(root, kind)
        ref = load_reference(path)
        want = [reference_greedy(ref, p, 12)[0] for p in prompts]
        for dtype in ("float32", "bfloat16"):
            llm = LLM(model=str(path), dtype=dtype, num_kv_blocks=256, max_num_batched_tokens=64)
            got = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
            same = sum(o.outputs[0].token_ids == w for o, w in zip(got, want))
            out[f"{kind}_{dtype}_greedy_equal"] = f"{same}/{len(prompts)}"
            del llm
        print(kind, json.dumps({k: v for k, v in out.items() if k.startswith(kind)}), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time 72 launch options per shape (bf16)")
    parser.add_argument("--engine", action="store_true", help="also run the DeepSeek engine against transformers")
    args = parser.parse_args()
    import transformers
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "transformers": transformers.__version__}))
    compare(torch.bfloat16)
    compare(torch.float32)
    if args.sweep:
        sweep(torch.bfloat16)
    if args.engine:
        engine_check()


if __name__ == "__main__":
    main()
