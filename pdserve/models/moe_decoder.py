"""The MoE families' decoder (Qwen2/3-MoE, Mixtral, gpt-oss) and what it, or DeepSeek's model,
hands the compiled decode step (pdserve.kernels.native_decode): each layer's attention (with
gpt-oss's o bias and sinks, or DeepSeek's latent attention) and its MLP, dense or a SparseMoE
whose routing and experts the C step knows (softmax then top k, top k then softmax, or DeepSeek's
grouped top k; SiLU or gpt-oss's clamped SwiGLU experts, biased or not; a shared expert, gated
or not), the experts float32 or gpt-oss's MXFP4 as held. A tensor-parallel rank runs its shard
(its heads, its slice of every expert) and sums the attention and MLP outputs through the rank
group's all-reduce, as the shard's hooks do (under expert parallelism, its experts whole). Anything
else (other quantized weights or experts) keeps its layers in Python, with the reason in the log."""
from __future__ import annotations

import functools

from torch import nn

from pdserve.kernels.native_decode import DecodeLayer, DecodeMLA, DecodeMoE, DecodeWeights
from pdserve.kernels.native_matrices import float_matrix, fp4_matrix
from pdserve.models.decoder import DecoderModel, summing_group
from pdserve.models.mla import MLAttention
from pdserve.models.moe import (
    DenseMLP,
    Experts,
    SparseMoE,
    clamped_swiglu,
    grouped_topk,
    silu_mul,
    softmax_topk,
    topk_softmax,
)
from pdserve.models.moe_quant import Mxfp4Experts

UNFIT_MATRIX = "a weight is not float32 on CPU, or its rows are not whole blocks of 32 columns"


class MoeDecoderModel(DecoderModel):
    """A MoE family's decoder, whose float32 decode steps on CPU take the compiled step."""

    def native_decode_weights(self) -> DecodeWeights | str:
        """The arrays of the compiled decode step, or why it cannot take them."""
        return decode_weights(self)


def decode_weights(model) -> DecodeWeights | str:
    """A decoder's arrays for the compiled step (its layers, norm and spec), or why not."""
    group = summing_group(model)
    if isinstance(group, str):
        return group
    layers = [native_layer(layer) for layer in model.layers]
    reason = next((r for r in layers if isinstance(r, str)), None)
    if reason is None:
        reason = next(filter(None, (layer.unfit() for layer in layers)), None)
    if reason is not None:
        return reason
    attn, norm, hidden = model.layers[0].self_attn, model.norm, model.spec.hidden_size
    # the dense layers' width (a rank's slice at TP > 1); the experts carry their own
    inter = next((layer.mlp.down_proj.weight.shape[1] for layer in model.layers if isinstance(layer.mlp, DenseMLP)),
                 model.spec.intermediate_size)
    if isinstance(attn, MLAttention):  # one latent "KV head" per head; the o product reads heads * v_head_dim
        s = attn.spec
        return DecodeWeights(layers, norm.weight, hidden, inter, s.num_heads, s.num_heads, s.v_head_dim, norm.eps,
                             s.softmax_scale, tp_group=group, rope_dim=s.qk_rope_head_dim)
    return DecodeWeights(layers, norm.weight, hidden, inter, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                         norm.eps, attn.scale, tp_group=group)


def native_layer(layer) -> DecodeLayer | str:
    """A layer of attention (PagedAttention, or DeepSeek's MLAttention), two RMSNorms and a
    DenseMLP or SparseMoE, as the C step reads it, or why it cannot."""
    attn, eps = layer.self_attn, layer.input_layernorm.eps
    if layer.post_attention_layernorm.eps != eps:
        return "the norms' eps differ"
    mlp = _native_mlp(layer.mlp)
    attention = _native_mla(attn) if isinstance(attn, MLAttention) else _native_attention(attn, eps)
    reason = next((r for r in (mlp, attention) if isinstance(r, str)), None)
    if reason is not None:
        return reason
    return DecodeLayer(input_norm=layer.input_layernorm.weight, post_norm=layer.post_attention_layernorm.weight,
                       **attention, **mlp)


def _float(linear) -> tuple | None:
    """The gemv's arguments for an unquantized linear layer's weight, or None."""
    return float_matrix(linear.weight) if type(linear) is nn.Linear else None


def _native_attention(attn, eps: float) -> dict | str:
    if attn.q_norm is not None and attn.q_norm.eps != eps:
        return "the QK norms' eps differs from the layer norms'"
    qkv, o = _float(attn.qkv_proj), _float(attn.o_proj)
    if qkv is None or o is None:
        return UNFIT_MATRIX
    qk_norms = (attn.q_norm.weight, attn.k_norm.weight) if attn.q_norm is not None else (None, None)
    return {"qkv": qkv, "o": o, "window": attn.window, "qkv_bias": attn.qkv_proj.bias, "q_norm": qk_norms[0],
            "k_norm": qk_norms[1], "o_bias": attn.o_proj.bias,
            "sinks": attn.sinks.data if attn.sinks is not None else None}


def _native_mla(attn: MLAttention) -> dict | str:
    s, lora = attn.spec, attn.spec.q_lora_rank or 0
    projections = (attn.q_a_proj, attn.q_b_proj) if lora else (attn.q_proj,)
    matrices = [_float(m) for m in (*projections, attn.kv_a_proj_with_mqa, attn.o_proj)]
    if any(m is None for m in matrices) or type(attn.kv_b_proj) is not nn.Linear or attn.kv_b_proj.bias is not None:
        return UNFIT_MATRIX
    if lora and attn.q_a_layernorm.eps != attn.kv_a_layernorm.eps:
        return "the latent norms' eps differ"
    q_a, q_b, q = (matrices[0], matrices[1], None) if lora else (None, None, matrices[0])
    mla = DecodeMLA(q_a, q_b, q, matrices[-2], attn.q_a_proj.bias if lora else None, attn.kv_a_proj_with_mqa.bias,
                    attn.q_a_layernorm.weight if lora else None, attn.kv_a_layernorm.weight, attn.kv_b_proj.weight,
                    lora, s.kv_lora_rank, s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim, s.rope_interleave,
                    attn.kv_a_layernorm.eps, s.softmax_scale)
    return {"qkv": None, "o": matrices[-1], "window": 0, "o_bias": attn.o_proj.bias, "mla": mla}


def _native_mlp(mlp) -> dict | str:
    if isinstance(mlp, SparseMoE):
        moe = _native_moe(mlp)
        return moe if isinstance(moe, str) else {"gate_up": None, "down": None, "moe": moe}
    if not isinstance(mlp, DenseMLP) or mlp.activation is not silu_mul:
        return f"a {type(mlp).__name__} MLP whose gate is not SiLU"
    gate_up, down = _float(mlp.gate_up_proj), _float(mlp.down_proj)
    if gate_up is None or down is None or mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
        return "the dense MLP has biases, or " + UNFIT_MATRIX
    return {"gate_up": gate_up, "down": down}


def _routing(mlp: SparseMoE) -> dict | str:
    """DecodeMoE's routing fields for the layer's route, or why the C step has none like it."""
    route = mlp.route
    if not isinstance(route, functools.partial):
        return "the experts' routing is not one the compiled step knows"
    if route.func is grouped_topk and mlp.gate.bias is None:
        k = route.keywords
        return {"top_k": k["top_k"], "renormalize": k.get("renormalize", True), "grouped": True,
                "sigmoid": k.get("scoring", "sigmoid") == "sigmoid", "n_group": k.get("n_group", 1),
                "topk_group": k.get("topk_group", 1), "group_top2": k.get("group_score", "top2_sum") == "top2_sum",
                "scaling": k.get("scaling", 1.0)}
    if mlp.e_score_correction_bias is not None:
        return "a correction bias outside DeepSeek's routing"
    if route.func is softmax_topk:
        return {"top_k": route.keywords["top_k"], "renormalize": route.keywords["renormalize"]}
    if route.func is topk_softmax:
        return {"top_k": route.keywords["top_k"], "renormalize": False, "topk_first": True}
    return f"the experts are routed by {route.func.__name__}"


def _activation(experts: Experts) -> dict | str:
    """DecodeMoE's alpha and limit for the experts' gate (none: SiLU), or why not."""
    act = experts.activation
    if act is silu_mul:
        return {}
    if isinstance(act, functools.partial) and act.func is clamped_swiglu and act.keywords["limit"] > 0:
        return {"alpha": act.keywords["alpha"], "limit": act.keywords["limit"]}
    return "the experts' gate is neither SiLU nor the clamped SwiGLU"


def _expert_matrices(experts: Experts) -> tuple[list, list] | str:
    """Each expert's gate_up and down as the compiled gemv takes them: float32, or MXFP4 as held."""
    every = range(experts.num_experts)  # (a rank's experts under expert parallelism)
    if type(experts) is Experts:
        return ([float_matrix(experts.gate_up_proj[e]) for e in every],
                [float_matrix(experts.down_proj[e]) for e in every])
    if type(experts) is Mxfp4Experts:
        return ([fp4_matrix(experts.gate_up_proj[e], experts.gate_up_scale[e]) for e in every],
                [fp4_matrix(experts.down_proj[e], experts.down_scale[e]) for e in every])
    return f"the experts are {type(experts).__name__}"


def _native_moe(mlp: SparseMoE) -> DecodeMoE | str:
    """A SparseMoE's arrays for the compiled step, or why not."""
    experts = mlp.experts
    routing, activation, matrices = _routing(mlp), _activation(experts), _expert_matrices(experts)
    for why in (routing, activation, matrices):
        if isinstance(why, str):
            return why
    gate_up, down = matrices
    matrices, shared, shared_args = [float_matrix(mlp.gate.weight), *gate_up, *down], mlp.shared_expert, {}
    if shared is not None:
        if shared.gate_up_proj.bias is not None or shared.down_proj.bias is not None:
            return "the shared expert has biases"
        shared_args = {"shared_gate_up": float_matrix(shared.gate_up_proj.weight),
                       "shared_down": float_matrix(shared.down_proj.weight),
                       "shared_inter": shared.down_proj.weight.shape[1]}  # (a rank's slice at TP > 1)
        matrices += [shared_args["shared_gate_up"], shared_args["shared_down"]]
    if any(m is None for m in matrices):
        return UNFIT_MATRIX
    data = {"router_bias": mlp.gate.bias, "gate_up_bias": experts.gate_up_bias, "down_bias": experts.down_bias,
            "shared_gate": mlp.shared_expert_gate.weight[0] if mlp.shared_expert_gate is not None else None,
            "correction_bias": mlp.e_score_correction_bias}
    data = {name: t.data for name, t in data.items() if t is not None}  # (parameters: their plain tensors)
    first = getattr(experts, "first_expert", 0)  # expert parallelism (pdserve.models.tp_shard): a rank's share
    return DecodeMoE(matrices[0], gate_up, down, inter=experts.intermediate, **routing, **activation, **shared_args,
                     **data, first_expert=first)
