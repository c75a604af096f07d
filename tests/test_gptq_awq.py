"""GPTQ and AWQ checkpoints, written here in their on-disk formats from a random Llama / Qwen2 /
Qwen3 (round-to-nearest quantization of its linear weights), load kept quantized and:
1. hold exactly the reference dequantization of the checkpoint's tensors;
2. generate the greedy tokens of transformers running a float32 model whose linear weights are
   those dequantized values (a dequantizing load);
3. unsupported variants are refused with the list of what loads;
   and activation order (desc_act) at TP 2 gives the same greedy tokens as item 2;
4. a float embedding / LM head whose values are Q8_0's (int8 times a float16 scale per 32 columns,
   as a GGUF's are once dequantized) is held as Q8_0, exactly, and tied when the model ties them.

The checkpoints and their reference dequantization come from
pdserve.testing.gptq_awq_checkpoints (AutoAWQ's packers and AWQ dequantizer; a GPTQ dequantizer
after GPTQModel's, which cannot be installed here).
"""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve import LLM
from pdserve.layers.quant import gptq_awq
from pdserve.layers.quant.gptq_awq import PermutedGroupedMethod, exact_int8_groups
from pdserve.layers.quant.grouped import GroupedLinearMethod
from pdserve.models.loader import ModelLoadError
from pdserve.testing.gptq_awq_checkpoints import quant_config, quantize, write_checkpoint
from pdserve.testing.model_factory import assert_matches_reference, make_model

SIZES = dict(hidden_size=128, intermediate_size=256)  # groups of 128 need inputs of 128 columns or more
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FUSED = {"self_attn.qkv_proj": LINEARS[:3], "self_attn.o_proj": LINEARS[3:4],
         "mlp.gate_up_proj": LINEARS[4:6], "mlp.down_proj": LINEARS[6:]}


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
    assert model.embed_tokens.quant_method.grouped is None  # random floats: no Q8_0 holds them, kept float
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


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case.get("desc_act")])
def test_desc_act_at_tp2_matches_dequantized_transformers(tmp_path, name):
    """Activation order at TP 2: a row-parallel layer's sorted columns take their inputs from
    every rank's shard (it gathers them); greedy tokens equal the dequantizing load's."""
    case = CASES[name]
    src = make_model(tmp_path, case["kind"], **case.get("sizes", SIZES))
    tensors, packed, refs = quantize(src, case)
    path = write_checkpoint(src, tmp_path / name, tensors, packed, quant_config(case), case.get("zero_biases", False))
    llm = LLM(str(path), tensor_parallel_size=2, num_kv_blocks=64)
    try:
        down = llm.engine.model.layers[0].mlp.down_proj
        assert isinstance(down.quant_method, PermutedGroupedMethod) and down.input_size * 2 == down.full_input_size
        assert_matches_reference(llm, dequantized_reference(src, refs), 3, (6, 19, 40), 16, 1e-3, name)
    finally:
        llm.close()


def q8_0_values(rows: int, cols: int, seed: int) -> torch.Tensor:
    """float32 [rows, cols] that are int8 times a float16 scale per 32 columns, each group's largest
    |q| 127 (as Q8_0 quantizes), the first row zero (a padding token's)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (rows, cols // 32, 32), generator=gen)
    q[:, :, 0] = 127 * (torch.randint(0, 2, (rows, cols // 32), generator=gen) * 2 - 1)
    scales = (torch.rand(rows, cols // 32, 1, generator=gen) * 0.02 + 1e-4).half().float()
    values = (q.float() * scales).reshape(rows, cols)
    values[0] = 0
    return values


def test_exact_int8_groups_only_where_exact(monkeypatch):
    monkeypatch.setattr(gptq_awq, "_VALUES_PER_CHECK", 96 * 7)  # chunks of 7 rows, the last one short
    w = q8_0_values(40, 96, seed=1)
    q, scales = exact_int8_groups(w.numpy())
    assert torch.equal(torch.from_numpy(q).float().reshape(40, 3, 32) * torch.from_numpy(scales).float()[..., None],
                       w.reshape(40, 3, 32))
    for value in (torch.nextafter(w[5, 7], torch.tensor(1.0)), torch.tensor(float("nan"))):
        off = w.clone()
        off[5, 7] = value  # one value no int8 times the group's scale gives
        assert exact_int8_groups(off.numpy()) is None
    assert exact_int8_groups(w[:, :80].contiguous().numpy()) is None  # not whole groups of 32


@pytest.mark.parametrize("kind", ["qwen2", "llama"])  # tied and untied embeddings
def test_q8_0_embedding_held_as_q8_0(tmp_path, kind):
    case = dict(method="gptq", bits=4, group_size=128, sym=True, v1=True)
    src = make_model(tmp_path, kind, **SIZES)
    tensors, packed, refs = quantize(src, case)
    floats = {m: q8_0_values(*tensors[f"{m}.weight"].shape, seed=i)
              for i, m in enumerate(("model.embed_tokens", "lm_head")) if f"{m}.weight" in tensors}
    tensors.update({f"{m}.weight": w for m, w in floats.items()})
    llm = LLM(str(write_checkpoint(src, tmp_path / "q8", tensors, packed, quant_config(case))), num_kv_blocks=64)
    model = llm.engine.model
    for layer, m in ((model.embed_tokens, "model.embed_tokens"), (model.lm_head, "lm_head")):
        method = layer.quant_method
        assert method.grouped is not None and layer.qweight.dtype == torch.int8 and not hasattr(layer, "weight")
        assert torch.equal(method.grouped.dequantized(layer), floats.get(m, floats["model.embed_tokens"]))
    tied = kind == "qwen2"
    assert (model.lm_head.qweight is model.embed_tokens.qweight) == tied
    assert_matches_reference(llm, dequantized_reference(src, {**refs, **floats}), 3, (6, 19, 40), 16, 1e-3, kind)
