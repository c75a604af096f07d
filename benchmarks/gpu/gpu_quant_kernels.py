"""The quantized linear layers' GEMMs alone, on one GPU, at the 1.1B Llama's shapes: bf16
(torch), FP8 with the activations quantized first in torch (per channel: _scaled_mm; blocks:
triton_quant's block GEMM), and W4A16 groups of 128 with the tile loaded as stored (nibble dots)
or gathered column by column. Each call launches on its own (no CUDA graph), so the times
include the launches, which the engine's decode graphs remove.

    python3 -m benchmarks.gpu.gpu_quant_kernels --out DIR [--rows 1,16,64,256]

Writes DIR/quant_kernels_bench.json: per shape and row count, each variant's median time
(triton.testing.do_bench, microseconds) and its time over bf16's. Also checks each variant's
output against the plain-torch reference on the GPU (max error over max |reference|).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

SHAPES = {"qkv": (2560, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632)}


def _operands(n: int, k: int) -> dict:
    from pdserve.layers.quant.grouped import GroupedWeight, scales_view
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen) * 0.02
    channel = w.abs().amax(1, keepdim=True) / 448
    blocks = w.reshape(n, k // 128, 128).abs().amax(-1) / 448
    q4 = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    grouped = GroupedWeight(q4.numpy(), (torch.rand(n, k // 128, generator=gen) * 0.01).numpy(), None, 128, 4)
    params = grouped.to_params(grouped.native_format())  # packed as the W4A16 layers hold it
    return {"w": w, "channel": channel, "blocks": blocks,  # blocks: per row and 128 columns
            "fp8_channel": (w / channel).to(torch.float8_e4m3fn),
            "fp8_blocks": (w / blocks.repeat_interleave(128, 1)).to(torch.float8_e4m3fn),
            "q4_packed": params["qweight"], "q4_scales": scales_view(params["scales"]).float()}


def _variants(ops: dict, x: torch.Tensor) -> dict:
    from pdserve.kernels import triton_quant, triton_quant_scaled_mm
    w16 = ops["w"].cuda().bfloat16()
    f8c, ch = ops["fp8_channel"].cuda(), ops["channel"].cuda()
    f8b, bl = ops["fp8_blocks"].cuda(), ops["blocks"].cuda()
    q, sc = ops["q4_packed"].cuda(), ops["q4_scales"].cuda()
    return {
        "bf16": lambda: x @ w16.t(),
        "fp8_channel_scaled_mm": lambda: triton_quant_scaled_mm.fp8_channel_matmul(x, f8c, ch, out_dtype=x.dtype),
        "fp8_block_unfused": lambda: triton_quant.fp8_block_matmul(x, f8b, bl, 128, out_dtype=x.dtype),
        "w4a16_nibble_dots": lambda: triton_quant.grouped_matmul(x, q, sc, None, 4, 128),
        "w4a16_gathered": lambda: triton_quant.grouped_matmul(x, q, sc, None, 4, 128, nibble_dots=False),
    }


def _reference(name: str, ops: dict, x: torch.Tensor) -> torch.Tensor:
    from pdserve.kernels import triton_quant, triton_quant_scaled_mm
    xf = x.float()
    if name == "bf16":
        return xf @ ops["w"].cuda().bfloat16().float().t()
    if name.startswith("fp8_channel"):
        return triton_quant_scaled_mm.fp8_channel_reference(xf, ops["fp8_channel"].cuda(), ops["channel"].cuda())
    if name.startswith("fp8_block"):
        return triton_quant.fp8_block_reference(xf, ops["fp8_blocks"].cuda(), ops["blocks"].cuda(), 128)
    return triton_quant.grouped_reference(xf, ops["q4_packed"].cuda(), ops["q4_scales"].cuda(), None, 4, 128)


def measure(rows: list[int]) -> dict:
    import triton.testing
    out = {}
    for shape, (n, k) in SHAPES.items():
        ops = _operands(n, k)
        for m in rows:
            x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 2).cuda().bfloat16()
            row = {}
            for name, fn in _variants(ops, x).items():
                try:
                    want = _reference(name, ops, x)
                    err = ((fn().float() - want).abs().max() / want.abs().max()).item()
                    row[name] = {"us": triton.testing.do_bench(fn, warmup=10, rep=40) * 1e3, "rel_err": err}
                except Exception as exc:  # noqa: BLE001 - one variant's failure is a result, not the end
                    row[name] = {"error": repr(exc)[:300]}
            base = row["bf16"].get("us")
            for r in row.values():
                if "us" in r and base:
                    r["vs_bf16"] = r["us"] / base
            out[f"{shape} {n}x{k} M={m}"] = row
            print(shape, m, {nm: round(r.get("us", -1), 1) for nm, r in row.items()}, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,16,64,256")
    args = ap.parse_args()
    result = measure([int(r) for r in args.rows.split(",")])
    result["gpu"] = torch.cuda.get_device_name(0)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "quant_kernels_bench.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
