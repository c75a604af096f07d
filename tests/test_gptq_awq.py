"""GPTQ and AWQ checkpoints, written here in their on-disk formats from a random Llama / Qwen2 /
Qwen3 (round-to-nearest quantization of its linear weights), load kept quantized and:
1. hold exactly the reference dequantization of the checkpoint's tensors;
2. generate the greedy tokens of transformers running a float32 model whose linear weights are
   those dequantized values (a dequantizing load);
3. unsupported variants are refused with the list of what loads.

The packed tensors come from AutoAWQ (PyPI `autoawq`, installed by scripts/setup.sh): its GEMM
packer (WQLinear_GEMM.from_linear) writes the AWQ checkpoints and its dequantizer
(dequantize_gemm) is the AWQ reference; its exllama packer (pack_exllama, the GPTQ layout: rows
packed along the input dimension, zeros along the output one) writes the GPTQ checkpoints, with
zero - 1 stored for the v1 format as AutoGPTQ does. GPTModel, whose dequantizer is GPTQ's
reference, is a source build with CUDA extensions and cannot be installed here; the GPTQ
reference below (gptq_reference) follows its torch QuantLinear.dequantize_weight:
scales[g_idx] * (q - zeros[g_idx]) with zeros + 1 in the v1 format.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from awq.modules.linear.gemm import WQLinear_GEMM
from awq.utils.packing_utils import dequantize_gemm, pack_exllama, reverse_awq_order, unpack_awq
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

from pdserve import LLM
from pdserve.layers.quant.gptq_awq import GptqAwqConfig, GptqAwqError, PermutedGroupedMethod
from pdserve.layers.quant.grouped import GroupedLinearMethod
from pdserve.models.loader import ModelLoadError
from pdserve.testing.model_factory import assert_matches_reference, make_model

SIZES = dict(hidden_size=128, intermediate_size=256)  # groups of 128 need inputs of 128 columns or more
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FUSED = {"self_attn.qkv_proj": LINEARS[:3], "self_attn.o_proj": LINEARS[3:4],
         "mlp.gate_up_proj": LINEARS[4:6], "mlp.down_proj": LINEARS[6:]}


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
    linear = nn.Linear(q.shape[1], q.shape[0], bias=False)
    cols = torch.arange(q.shape[1]) // group  # from_linear re-derives q from the weight it is given
    linear.weight.data = ((q - zeros[cols].T) * scales[cols].T.float()).float()
    packed = WQLinear_GEMM.from_linear(linear, 4, group, scales=scales, zeros=zeros)
    return {"qweight": packed.qweight, "qzeros": packed.qzeros, "scales": packed.scales}


def awq_reference(parts: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    """float32 [out, in] from AutoAWQ's unpacking; its own float16 dequantizer must agree."""
    q, zeros = reverse_awq_order(*unpack_awq(parts["qweight"], parts["qzeros"], 4), 4)
    q, zeros = q & 15, zeros & 15
    rows = torch.arange(q.shape[0]) // group
    exact = ((q - zeros[rows]).float() * parts["scales"][rows].float()).T.contiguous()
    assert torch.equal(dequantize_gemm(parts["qweight"], parts["qzeros"], parts["scales"], 4, group).T,
                       exact.half())
    return exact


def quantize(src, case: dict, seed: int = 0):
    """The packed parts of every decoder linear of src, and their reference dequantization."""
    tensors = load_file(str(src / "model.safetensors"))
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


def dequantized_reference(src, refs: dict[str, torch.Tensor]):
    """transformers' float32 model of src with each quantized linear's weight replaced by its
    reference dequantization."""
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for module, w in refs.items():
            model.get_submodule(module).weight.copy_(w)
    model.generation_config.eos_token_id = None
    return model


CASES = {
    "gptq-4bit-g128-sym": dict(kind="llama", method="gptq", bits=4, group_size=128, sym=True, v1=True),
    "gptq-4bit-g128-desc_act-asym": dict(kind="qwen2", method="gptq", bits=4, group_size=128, sym=False,
                                         desc_act=True, v1=True, zero_biases=True),
    "gptq-8bit-channel-sym": dict(kind="qwen3", method="gptq", bits=8, group_size=-1, sym=True, v1=True),
    "gptq-8bit-g128-desc_act-asym-v2": dict(kind="llama", method="gptq", bits=8, group_size=128, sym=False,
                                            desc_act=True, v1=False),
    # 192 and 320 columns: the last group of 128 has 64 (as in SmolLM2's 576), held as groups of 64
    "gptq-4bit-g128-ragged": dict(kind="llama", method="gptq", bits=4, group_size=128, sym=False, v1=True,
                                  sizes=dict(hidden_size=192, intermediate_size=320, num_attention_heads=6)),
    "awq-4bit-g128": dict(kind="qwen2", method="awq", bits=4, group_size=128, sym=False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_loads_exact_and_matches_dequantized_transformers(tmp_path, name):
    case = CASES[name]
    src = make_model(tmp_path, case["kind"], **case.get("sizes", SIZES))
    tensors, packed, refs = quantize(src, case)
    path = write_checkpoint(src, tmp_path / name, tensors, packed, quant_config(case), case.get("zero_biases", False))
    llm = LLM(str(path), num_kv_blocks=64)
    model = llm.engine.model
    for i, layer in enumerate(model.layers):
        for fused, parts in FUSED.items():
            linear = layer.get_submodule(fused)
            method = linear.quant_method
            assert isinstance(method, PermutedGroupedMethod if case.get("desc_act") else GroupedLinearMethod)
            assert method.fmt.bits == case["bits"]
            want = torch.cat([refs[f"model.layers.{i}.{p}"] for p in parts])
            assert torch.equal(method.dequantized(linear), want), f"{name}: layers.{i}.{fused}"
    assert_matches_reference(llm, dequantized_reference(src, refs), 3, (6, 19, 40), 16, 1e-3, name)


REFUSED = [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3-bit weights"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "checkpoint_format 'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "is_marlin_format": True}, "checkpoint_format 'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"-:.*down": {}}}, "dynamic"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version 'gemv'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "backend": "llm-awq"},
     "backend 'llm-awq'"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128, "version": "gemm"}, "8-bit weights"),
]


@pytest.mark.parametrize("qconfig,what", REFUSED, ids=[w for _, w in REFUSED])
def test_unsupported_variants_are_refused(tmp_path, qconfig, what):
    src = make_model(tmp_path, "llama", **SIZES)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = qconfig
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=rf"{what}.*pdserve loads GPTQ \(4 or 8 bits.*AWQ \(version gemm"):
        LLM(str(src), num_kv_blocks=8)


def test_desc_act_refused_where_the_input_is_split():
    config = GptqAwqConfig({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True})
    row_parallel = SimpleNamespace(split_input=True, tp=SimpleNamespace(size=2), input_size=128)
    with pytest.raises(GptqAwqError, match="desc_act at tensor_parallel_size 2"):
        config.linear_method(row_parallel, "layers.0.self_attn.o_proj")
    column_parallel = SimpleNamespace(split_input=False, tp=SimpleNamespace(size=2), input_size=128)
    assert isinstance(config.linear_method(column_parallel, "layers.0.mlp.gate_up_proj"), PermutedGroupedMethod)
