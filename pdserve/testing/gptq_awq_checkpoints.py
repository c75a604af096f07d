"""GPTQ and AWQ checkpoints written from a float32 one, for tests and benchmarks: round-to-nearest
quantization of each decoder linear (GPTQ's quantizer grid, no calibration), packed by AutoAWQ
(PyPI `autoawq`, which scripts/setup.sh installs for the tests): its GEMM packer
(WQLinear_GEMM.from_linear) for AWQ, its exllama packer (pack_exllama: the GPTQ layout, rows
packed along the input dimension, zeros along the output one) for GPTQ, with zero - 1 stored
for the v1 format as AutoGPTQ does. Each packed module comes with its reference dequantization:
AutoAWQ's own for AWQ; for GPTQ, whose reference package (GPTQModel) builds CUDA extensions from
source and cannot be installed here, gptq_reference, after GPTQModel's
QuantLinear.dequantize_weight: scales[g_idx] * (q - zeros[g_idx]), zeros + 1 in the v1 format.
"""
from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file
from torch import nn


def rtn(w: torch.Tensor, g_idx: torch.Tensor, bits: int, sym: bool):
    """Round-to-nearest with GPTQ's quantizer grid: q [out, in], zeros [groups, out] (integers),
    scales [groups, out] float16."""
    maxq, groups = 2 ** bits - 1, int(g_idx.max()) + 1
    q = torch.zeros_like(w, dtype=torch.int32)
    zeros = torch.zeros(groups, w.shape[0], dtype=torch.int32)
    scales = torch.zeros(groups, w.shape[0], dtype=torch.float16)
    for g in range(groups):
        cols = g_idx == g
        lo, hi = w[:, cols].amin(1).clamp(max=0), w[:, cols].amax(1).clamp(min=0)
        if sym:
            scale, zero = (2 * torch.maximum(-lo, hi) / maxq).half(), torch.full_like(lo, (maxq + 1) // 2)
        else:
            scale = ((hi - lo) / maxq).half()
            zero = torch.round(-lo / scale.float())
        q[:, cols] = torch.clamp(torch.round(w[:, cols] / scale.float()[:, None] + zero[:, None]), 0, maxq).int()
        zeros[g], scales[g] = zero.int(), scale
    return q, zeros, scales


def gptq_pack(q, zeros, scales, g_idx, bits: int, v1: bool) -> dict[str, torch.Tensor]:
    if v1:
        assert (zeros >= 1).all()  # v1 cannot store a zero point of 0 (zero - 1 borrows from the next field)
    # optional dependency: autoawq (scripts/setup.sh installs it for the tests)
    from awq.utils.packing_utils import pack_exllama
    qweight, qzeros = pack_exllama(q.T.contiguous(), zeros - 1 if v1 else zeros, bits)
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx.int()}


def gptq_reference(parts: dict[str, torch.Tensor], bits: int, v1: bool) -> torch.Tensor:
    """float32 [out, in], as GPTQModel's QuantLinear.dequantize_weight (computed in float32)."""
    shifts, mask = torch.arange(0, 32, bits, dtype=torch.int32), 2 ** bits - 1
    qweight, qzeros = parts["qweight"], parts["qzeros"]
    q = ((qweight[:, None, :] >> shifts[None, :, None]) & mask).reshape(-1, qweight.shape[1])
    zeros = ((qzeros[:, :, None] >> shifts[None, None, :]) & mask).reshape(qzeros.shape[0], -1) + int(v1)
    g = parts["g_idx"].long()
    return (parts["scales"][g].float() * (q - zeros[g]).float()).T.contiguous()


def awq_pack(q, zeros, scales, group: int) -> dict[str, torch.Tensor]:
    # optional dependency: autoawq (scripts/setup.sh installs it for the tests)
    from awq.modules.linear.gemm import WQLinear_GEMM
    linear = nn.Linear(q.shape[1], q.shape[0], bias=False)
    cols = torch.arange(q.shape[1]) // group  # from_linear re-derives q from the weight it is given
    linear.weight.data = ((q - zeros[cols].T) * scales[cols].T.float()).float()
    packed = WQLinear_GEMM.from_linear(linear, 4, group, scales=scales, zeros=zeros)
    return {"qweight": packed.qweight, "qzeros": packed.qzeros, "scales": packed.scales}


def awq_reference(parts: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    """float32 [out, in] from AutoAWQ's unpacking; its own float16 dequantizer must agree."""
    # optional dependency: autoawq (scripts/setup.sh installs it for the tests)
    from awq.utils.packing_utils import dequantize_gemm, reverse_awq_order, unpack_awq
    q, zeros = reverse_awq_order(*unpack_awq(parts["qweight"], parts["qzeros"], 4), 4)
    q, zeros = q & 15, zeros & 15
    rows = torch.arange(q.shape[0]) // group
    exact = ((q - zeros[rows]).float() * parts["scales"][rows].float()).T.contiguous()
    assert torch.equal(dequantize_gemm(parts["qweight"], parts["qzeros"], parts["scales"], 4, group).T,
                       exact.half())
    return exact


def quantize(src, case: dict, seed: int = 0):
    """The packed parts of every decoder linear of src, and their reference dequantization."""
    tensors = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    gen = torch.Generator().manual_seed(seed)
    packed, refs = {}, {}
    for name in [n for n in tensors if n.endswith("_proj.weight") and ".layers." in n]:
        module, w = name.removesuffix(".weight"), tensors[name]
        group = case["group_size"] if case["group_size"] > 0 else w.shape[1]
        g_idx = torch.arange(w.shape[1]) // group
        if case.get("desc_act"):  # activation order: each group a random set of columns
            g_idx = g_idx[torch.argsort(torch.randperm(w.shape[1], generator=gen))]
        q, zeros, scales = rtn(w, g_idx, case["bits"], case["sym"])
        if case["method"] == "gptq":
            packed[module] = gptq_pack(q, zeros, scales, g_idx, case["bits"], case["v1"])
            refs[module] = gptq_reference(packed[module], case["bits"], case["v1"])
        else:
            packed[module] = awq_pack(q, zeros, scales, group)
            refs[module] = awq_reference(packed[module], group)
        assert torch.equal(refs[module], ((q - zeros[g_idx].T) * scales[g_idx].T.float()).float())
    return tensors, packed, refs


def quant_config(case: dict) -> dict:
    if case["method"] == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": case["group_size"], "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    return {"quant_method": "gptq", "bits": case["bits"], "group_size": case["group_size"],
            "desc_act": case.get("desc_act", False), "sym": case["sym"], "static_groups": False,
            "true_sequential": True, "damp_percent": 0.01, "lm_head": False,
            "checkpoint_format": "gptq" if case["v1"] else "gptq_v2"}


def write_checkpoint(src, out, tensors, packed, qconfig: dict, zero_biases: bool = False):
    """src's checkpoint with each packed module's weight replaced by its parts (and, as some GPTQ
    writers do, a zero bias on every quantized module that has none)."""
    tensors = dict(tensors)
    for module, parts in packed.items():
        del tensors[f"{module}.weight"]
        tensors.update({f"{module}.{k}": v.contiguous() for k, v in parts.items()})
        if zero_biases and f"{module}.bias" not in tensors:
            tensors[f"{module}.bias"] = torch.zeros(parts["scales"].shape[1], dtype=torch.float16)
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = qconfig
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (src / name).is_file():
            (out / name).write_bytes((src / name).read_bytes())
    return out
