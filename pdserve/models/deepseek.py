"""DeepSeek-V2 and DeepSeek-V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM) over pdserve's
paged latent cache: multi-head latent attention (pdserve.models.mla), the first
first_k_dense_replace layers dense, the rest mixture-of-experts with shared experts
(pdserve.models.moe). Checked against transformers 5.24.

Routing as transformers does it: V3 scores experts with a sigmoid, chooses by score +
e_score_correction_bias inside the topk_group best of n_group groups (a group scored by its two
best experts), weights by the unbiased scores, renormalised if norm_topk_prob, times
routed_scaling_factor. V2 scores with a softmax, topk_method "greedy" or "group_limited_greedy"
(a group scored by its best expert), never renormalises, and scales by routed_scaling_factor.

FP8 block checkpoints as DeepSeek-V3 ships them (pdserve.layers.quant.fp8_block) load on CPU with
the dense MLPs, the routed and shared experts (pdserve.models.moe_quant) and MLA's projections
kept FP8; kv_b_proj (which the absorbed decode reads as matrices) is dequantized at load.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pdserve.kernels.native_decode import DecodeWeights
from pdserve.layers.quant import fp8_block
from pdserve.models.llama import RMSNorm
from pdserve.models.mla import MLASpec, MLAttention, mla_softmax_scale
from pdserve.models.moe import DenseMLP, SparseMoE, grouped_topk
from pdserve.models.moe_decoder import decode_weights
from pdserve.models.moe_quant import Fp8Experts
from pdserve.models.rope import RotaryEmbedding

DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
LOADS_QUANTIZED = True  # check_config vets the quantization_config (pdserve.models.loader)


@dataclass
class DeepseekSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_layers: int
    first_k_dense_replace: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    mla: MLASpec
    num_experts: int
    num_shared_experts: int
    route: functools.partial


def _refuse(arch: str, message: str) -> None:
    raise ValueError(f"{arch}: {message}")


def check_config(config) -> None:
    """Refuse what transformers itself would not run the same way, or pdserve does not do
    (ValueError naming it)."""
    arch = config.architectures[0]
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        try:
            fp8_block.block_size(quantization if isinstance(quantization, dict) else quantization.to_dict())
        except ValueError as exc:
            _refuse(arch, str(exc))
    if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        _refuse(arch, f"hidden_act {config.hidden_act!r} is not supported; supported: silu")
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if kv_heads != config.num_attention_heads:
        _refuse(arch, f"num_key_value_heads ({kv_heads}) must equal num_attention_heads "
                      f"({config.num_attention_heads}) for multi-head latent attention")
    if not config.n_shared_experts:
        _refuse(arch, "n_shared_experts must be at least 1 (transformers builds the shared experts always)")
    if getattr(config, "mlp_bias", False):
        _refuse(arch, "mlp_bias=True is not supported")
    if (getattr(config, "moe_layer_freq", 1) or 1) != 1:
        _refuse(arch, f"moe_layer_freq {config.moe_layer_freq} is not supported (transformers uses 1)")
    if arch == "DeepseekV3ForCausalLM":
        if getattr(config, "scoring_func", "sigmoid") != "sigmoid" or \
                getattr(config, "topk_method", "noaux_tc") != "noaux_tc":
            _refuse(arch, "only sigmoid scoring with noaux_tc top-k is supported (as transformers runs V3)")
    elif getattr(config, "scoring_func", "softmax") != "softmax":
        _refuse(arch, f"scoring_func {config.scoring_func!r} is not supported (transformers runs V2 with softmax)")
    _route(config, arch)


def _route(config, arch: str) -> functools.partial:
    experts, n_group = config.n_routed_experts, config.n_group or 1
    common = dict(top_k=config.num_experts_per_tok, scaling=float(config.routed_scaling_factor))
    if arch == "DeepseekV3ForCausalLM":
        group_score, scoring, renormalize, topk_group = "top2_sum", "sigmoid", bool(config.norm_topk_prob), \
            config.topk_group or 1
    elif config.topk_method == "greedy":
        group_score, scoring, renormalize, n_group, topk_group = "max", "softmax", False, 1, 1
    elif config.topk_method == "group_limited_greedy":
        group_score, scoring, renormalize, topk_group = "max", "softmax", False, config.topk_group or 1
    else:
        _refuse(arch, f"topk_method {config.topk_method!r} is not supported; "
                      f"supported: greedy, group_limited_greedy")
    if experts % n_group or not 1 <= topk_group <= n_group:
        _refuse(arch, f"n_routed_experts {experts} in n_group {n_group} with topk_group {topk_group} "
                      f"do not form whole groups")
    if n_group > 1 and group_score == "top2_sum" and experts // n_group < 2:
        _refuse(arch, "each expert group needs at least 2 experts (groups are scored by their best two)")
    if common["top_k"] > experts // n_group * topk_group:
        _refuse(arch, f"num_experts_per_tok {common['top_k']} exceeds the experts of the kept groups")
    return functools.partial(grouped_topk, scoring=scoring, n_group=n_group, topk_group=topk_group,
                             group_score=group_score, renormalize=renormalize, **common)


def deepseek_spec(config) -> DeepseekSpec:
    arch = config.architectures[0]
    check_config(config)
    rope_params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    mla = MLASpec(
        hidden_size=config.hidden_size, num_heads=config.num_attention_heads, q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
        attention_bias=bool(getattr(config, "attention_bias", False)),
        # V2 rotates interleaved pairs (complex multiply); V3 does when rope_interleave (default).
        rope_interleave=arch == "DeepseekV2ForCausalLM" or bool(getattr(config, "rope_interleave", True)),
        softmax_scale=mla_softmax_scale(qk_head_dim, rope_params))
    return DeepseekSpec(
        architecture=arch, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, moe_intermediate_size=config.moe_intermediate_size,
        num_layers=config.num_hidden_layers, first_k_dense_replace=config.first_k_dense_replace or 0,
        rms_norm_eps=config.rms_norm_eps, tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_position_embeddings=config.max_position_embeddings, mla=mla, num_experts=config.n_routed_experts,
        num_shared_experts=config.n_shared_experts, route=_route(config, arch))


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, spec: DeepseekSpec, layer_idx: int):
        super().__init__()
        self.self_attn = MLAttention(spec.mla, layer_idx)
        if layer_idx < spec.first_k_dense_replace:
            self.mlp = DenseMLP(spec.hidden_size, spec.intermediate_size)
        else:
            self.mlp = SparseMoE(spec.hidden_size, spec.moe_intermediate_size, spec.num_experts, spec.route,
                                 shared_intermediate=spec.moe_intermediate_size * spec.num_shared_experts,
                                 correction_bias=spec.architecture == "DeepseekV3ForCausalLM", router_fp32=True)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekModel(nn.Module):
    """forward(token_ids [T], positions [T], ctx) -> final hidden states [T, hidden]."""

    # The MLA ops read context lengths on the host: not capturable in a CUDA graph.
    cuda_graph_safe = False
    # pdserve.kernels.native_decode.NativeDecode on CPU where the layers fit it (set by the model
    # runner from native_decode_weights): a float32 decode step's layers in one compiled call.
    native_decode = None

    def __init__(self, spec: DeepseekSpec, rope: RotaryEmbedding):
        super().__init__()
        self.spec, self.rope = spec, rope
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.fused = None  # the fused Llama-layer kernels do not apply to these layers

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        x = self.embed_tokens(token_ids)
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        if self.native_decode is not None and self.native_decode.takes(x, ctx):
            return self.native_decode.forward(x, cos, sin, ctx)
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def native_decode_weights(self) -> DecodeWeights | str:
        """The arrays of the compiled decode step (latent attention, grouped routing), or why not."""
        return decode_weights(self)


def build_model(config, files: list[Path], dtype: torch.dtype, device: torch.device) -> DeepseekModel:
    """The model from a transformers config and the checkpoint's safetensors files."""
    spec = deepseek_spec(config)
    rope = RotaryEmbedding(config, spec.mla.qk_rope_head_dim, spec.max_position_embeddings)
    quantization = getattr(config, "quantization_config", None)
    with torch.device("meta"):
        model = DeepseekModel(spec, rope)
        if quantization:
            block = fp8_block.block_size(quantization if isinstance(quantization, dict) else quantization.to_dict())
            _keep_fp8(model, fp8_block.fp8_modules(files), block)
    model = model.to_empty(device="cpu")
    tensors = _read_tensors(files)
    load_weights(model, fp8_block.fp8_block_tensors(tensors, block, _keeps_fp8) if quantization else tensors)
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rope = rope.to(device)
    return model.to(device=device, dtype=dtype).eval()


def _keeps_fp8(module: str) -> bool:
    """Checkpoint modules kept FP8: all but kv_b_proj (the absorbed decode multiplies its
    matrices directly)."""
    return not module.endswith("kv_b_proj")


def _keep_fp8(model: DeepseekModel, quantized: set[str], block: tuple[int, int]) -> None:
    """Swap each nn.Linear whose checkpoint weights are FP8 and kept for an FP8 layer, and each
    layer's experts for FP8 experts when the checkpoint's are FP8."""
    for name, module in list(model.named_modules()):
        if isinstance(module, SparseMoE) and f"{name}.experts.0.gate_proj" in quantized:
            module.experts = Fp8Experts.like(module.experts, block[1])
        source = name.replace("shared_expert.", "shared_experts.").replace("gate_up_proj", "gate_proj")
        if isinstance(module, nn.Linear) and source in quantized and _keeps_fp8(source):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, fp8_block.fp8_linear(module, block, name))


def _read_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(model: DeepseekModel, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters())
    filled = {name: 0 for name in params}  # elements copied into each parameter
    for name, tensor in tensors:
        for param, view in _targets(model, name, tensor, params):
            _copy(view, tensor, name)
            filled[param] += tensor.numel()
    tied = model.spec.tie_word_embeddings
    missing = sorted(n for n, p in params.items()
                     if filled[n] < p.numel() and not (tied and n == "lm_head.weight"))
    if missing:
        raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}"
                         + (" ..." if len(missing) > 8 else ""))


def _targets(model: DeepseekModel, name: str, tensor: torch.Tensor, params: dict) -> list[tuple[str, torch.Tensor]]:
    """Where one checkpoint tensor goes: (parameter name, the view of it to fill)."""
    name = name if name.startswith("lm_head") else name.removeprefix("model.")
    parts = name.split(".")
    if "rotary_emb" in name or (parts[0] == "layers" and int(parts[1]) >= model.spec.num_layers):
        return []  # the multi-token-prediction layers after the last one are not used for decoding
    if len(parts) > 4 and parts[2] == "mlp" and parts[3] in ("experts", "shared_experts", "gate"):
        prefix = ".".join(parts[:3])
        renamed = _MOE_NAMES.get(parts[3], parts[3])
        if parts[3] == "experts" and parts[4].isdigit():  # one expert's [out, in] matrix
            e, part = int(parts[4]), parts[5]
            kind = "scale" if parts[6] == "weight_scale" else "proj"  # an FP8 expert's scales
            target = f"{prefix}.experts.{'down' if part == 'down_proj' else 'gate_up'}_{kind}"
            return [(target, _half(params[target].data[e], part))]
        name = ".".join([prefix, renamed, *parts[4:]])
        if parts[3] == "gate" and parts[4] == "e_score_correction_bias":
            name = f"{prefix}.e_score_correction_bias"
    if parts[-2] in ("gate_proj", "up_proj"):  # dense MLPs hold gate and up fused
        target = ".".join(name.split(".")[:-2] + ["gate_up_proj", parts[-1]])
        if target in params:
            return [(target, _half(params[target].data, parts[-2]))]
    if name not in params:
        if name == "lm_head.weight" and model.spec.tie_word_embeddings:
            return []
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
    return [(name, params[name].data)]


_MOE_NAMES = {"shared_experts": "shared_expert"}


def _half(weight: torch.Tensor, part: str) -> torch.Tensor:
    """gate_proj -> the first half of a fused gate_up weight, up_proj -> the second, else all."""
    if part not in ("gate_proj", "up_proj"):
        return weight
    half = weight.shape[0] // 2
    return weight[:half] if part == "gate_proj" else weight[half:]


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"weight {name}: shape {tuple(src.shape)} in the checkpoint, expected {tuple(dst.shape)}")
    dst.copy_(src)
