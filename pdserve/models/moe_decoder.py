"""The MoE families' decoder (Qwen2/3-MoE, Mixtral, gpt-oss) and what it hands the compiled
decode step (pdserve.kernels.native_decode): each layer's attention (with gpt-oss's o bias and
sinks) and its MLP, dense or a SparseMoE whose routing and experts the C step knows (softmax
then top k, or top k then softmax; SiLU or gpt-oss's clamped SwiGLU experts, biased or not; a
gated shared expert). Anything else (quantized experts, DeepSeek's grouped routing, TP shards)
keeps its layers in Python, with the reason in the log."""
from __future__ import annotations

import functools

from pdserve.kernels.native_decode import DecodeLayer, DecodeMoE, DecodeWeights, float_matrix
from pdserve.models.decoder import DecoderModel
from pdserve.models.moe import DenseMLP, Experts, SparseMoE, clamped_swiglu, silu_mul, softmax_topk, topk_softmax

UNFIT_MATRIX = "a weight is not float32 on CPU, or its rows are not whole blocks of 32 columns"


class MoeDecoderModel(DecoderModel):
    """A MoE family's decoder, whose float32 decode steps on CPU take the compiled step."""

    def native_decode_weights(self) -> DecodeWeights | str:
        """The arrays of the compiled decode step, or why it cannot take them."""
        if self.tp_sharded():
            return "the layers are tensor-parallel shards (the compiled step does not sum them)"
        layers = [_native_layer(layer) for layer in self.layers]
        reason = next((r for r in layers if isinstance(r, str)), None)
        if reason is None:
            reason = next(filter(None, (layer.unfit() for layer in layers)), None)
        if reason is not None:
            return reason
        attn, norm = self.layers[0].self_attn, self.norm
        return DecodeWeights(layers, norm.weight, self.spec.hidden_size, self.spec.intermediate_size,
                             attn.num_heads, attn.num_kv_heads, attn.head_dim, norm.eps, attn.scale)


def _native_layer(layer) -> DecodeLayer | str:
    """A layer of PagedAttention, two RMSNorms and a DenseMLP or SparseMoE, as the C step reads it."""
    attn, mlp = layer.self_attn, layer.mlp
    norms = [layer.input_layernorm, layer.post_attention_layernorm] + ([attn.q_norm] if attn.q_norm else [])
    if len({n.eps for n in norms}) > 1:
        return "the norms' eps differ"
    if not isinstance(mlp, SparseMoE | DenseMLP):
        return f"a {type(mlp).__name__} MLP"
    moe = _native_moe(mlp) if isinstance(mlp, SparseMoE) else None
    if isinstance(moe, str):
        return moe
    dense = (mlp.gate_up_proj, mlp.down_proj) if moe is None else ()
    if any(m.bias is not None for m in dense) or (dense and mlp.activation is not silu_mul):
        return "the dense MLP has biases, or its gate is not SiLU"
    matrices = [float_matrix(m.weight) for m in (attn.qkv_proj, attn.o_proj, *dense)]
    if any(m is None for m in matrices):
        return UNFIT_MATRIX
    qk_norms = (attn.q_norm.weight, attn.k_norm.weight) if attn.q_norm is not None else (None, None)
    gate_up, down = matrices[2:] or (None, None)
    sinks = attn.sinks.data if attn.sinks is not None else None
    return DecodeLayer(matrices[0], matrices[1], gate_up, down, layer.input_layernorm.weight,
                       layer.post_attention_layernorm.weight, attn.window, attn.qkv_proj.bias, *qk_norms, moe=moe,
                       o_bias=attn.o_proj.bias, sinks=sinks)


def _routing(mlp: SparseMoE) -> dict | str:
    """DecodeMoE's routing fields for the layer's route, or why the C step has none like it."""
    route = mlp.route
    if not isinstance(route, functools.partial) or mlp.router_fp32 or mlp.e_score_correction_bias is not None:
        return "the experts' routing is not a softmax and a top k"
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


def _native_moe(mlp: SparseMoE) -> DecodeMoE | str:
    """A SparseMoE's arrays for the compiled step, or why not."""
    experts = mlp.experts
    if type(experts) is not Experts:
        return f"the experts are {type(experts).__name__}"
    routing, activation = _routing(mlp), _activation(experts)
    if isinstance(routing, str) or isinstance(activation, str):
        return routing if isinstance(routing, str) else activation
    gate_up = [float_matrix(experts.gate_up_proj[e]) for e in range(experts.num_experts)]
    down = [float_matrix(experts.down_proj[e]) for e in range(experts.num_experts)]
    router, shared = float_matrix(mlp.gate.weight), mlp.shared_expert
    shared_args = {}
    if shared is not None:
        shared_args = {"shared_gate_up": float_matrix(shared.gate_up_proj.weight),
                       "shared_down": float_matrix(shared.down_proj.weight),
                       "shared_inter": shared.down_proj.in_features}
        if shared.gate_up_proj.bias is not None or shared.down_proj.bias is not None:
            return "the shared expert has biases"
    if any(m is None for m in [router, *gate_up, *down, shared_args.get("shared_gate_up", ()),
                               shared_args.get("shared_down", ())]):
        return UNFIT_MATRIX
    data = {"router_bias": mlp.gate.bias, "gate_up_bias": experts.gate_up_bias, "down_bias": experts.down_bias,
            "shared_gate": mlp.shared_expert_gate.weight[0] if mlp.shared_expert_gate is not None else None}
    data = {name: t.data for name, t in data.items() if t is not None}  # (parameters: their plain tensors)
    return DecodeMoE(router, gate_up, down, inter=experts.intermediate, **routing, **activation, **shared_args, **data)
