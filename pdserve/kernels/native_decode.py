"""A decode step through every layer of a Llama-family model in one compiled call
(native_decode.c, built with native_gemv.c into one library).

At one request a SmolLM2 decode step spent about 5 of its 13 ms in Python between the kernels:
some ten calls a layer over 30 layers. For a step whose rows are all decode rows (at most
MAX_STEP_TOKENS of them), with weights the compiled gemv takes (quantized in its layouts, or
float32 read as they are) and a float32 KV cache, the model hands its layers to this one call;
anything else runs the layers in Python as before. At tensor_parallel_size > 1 every rank runs
its shard so (the driver's runner and each worker plan it alike), and the o and down products'
partial sums go through the rank group's all-reduce, called back from C, as RowParallelLinear's do: the same collectives in the same
order, so a rank that ran its layers in Python would still pair with the others. A decode row
is one token: a plain decode's, or one of the k + 1 rows of a speculative verify step (n-gram,
draft model, EAGLE, MTP), each with its own context length, so the rows of one request are
causal among themselves. Qwen2's qkv bias and Qwen3's per-head QK norms are part of the
compiled layer, and so are LoRA adapters: each row's adapter delta on the four products (the
rows of a step may each have another adapter). A MoE layer (DecodeMoE: Qwen2/3-MoE, Mixtral,
gpt-oss, DeepSeek) routes each row and runs its experts in C (native_moe.c), and DeepSeek's
latent attention (DecodeMLA) runs there too (native_mla.c). The embedding, the LM head and
sampling stay in Python.

A model declares whether it fits (native_decode_weights: its arrays as a DecodeWeights, or why
not); this module reads only those arrays. The plan (plan_for) is made once per model runner:
the C structs hold pointers into the model's weight arrays and the runner's KV cache, which live
as long as the runner.
"""
from __future__ import annotations

import ctypes
import logging
from ctypes import POINTER, c_float, c_int32, c_int64, c_void_p
from dataclasses import dataclass
from typing import Protocol

import numba
import torch

from pdserve.kernels import native_gemv
from pdserve.kernels.native_matrices import float32_on_cpu

log = logging.getLogger(__name__)

# Rows a compiled step takes: a verify step of 8 requests with k = 4 has 40. Past 8 rows the gemv
# dequantizes each pair of weight rows once for all of them (native_gemv.c), so it keeps ahead of
# the Python layers' dequantized tiles through BLAS up to here: SmolLM2 Q4_1 at 128 requests took
# 345 ms a step compiled against 530 in the Python layers in float32, 230 against 386 with bf16
# products (benchmarks/engine/step_profile.py; it was 64 rows, measured before the bf16 products).
MAX_STEP_TOKENS = 256


class _Matrix(ctypes.Structure):
    _fields_ = [("q", c_void_p), ("scales", c_void_p), ("mins", c_void_p), ("nrows", c_int32), ("bits", c_int32),
                ("half", c_int32), ("has_min", c_int32), ("group", c_int32), ("pack", c_void_p)]

    @classmethod
    def of(cls, args: tuple | None) -> _Matrix:
        """From native_gemv.matrix_args: (q, rows, bits, scales, mins, half, has_min, group, pack);
        None: a matrix the layer does not have (all zeros, never read)."""
        if args is None:
            return cls()
        q, rows, bits, scales, mins, half, has_min, group, pack = args
        return cls(q, scales, mins, rows, bits, half, has_min, group, pack)


class _Lora(ctypes.Structure):
    _fields_ = [("a", c_void_p), ("b", c_void_p), ("width", c_int32), ("ld", c_int32), ("out", c_int32)]

    @classmethod
    def of(cls, slots) -> _Lora:
        """From a layer's LoRALayerSlots (pdserve.lora.slots), or None: no LoRA."""
        if slots is None:
            return cls(None, None, 0, 0, 0)
        a, b = slots.a_stack, slots.b_stack
        return cls(a.data_ptr(), b.data_ptr(), slots.stride, a.shape[1], b.shape[1])


class _Moe(ctypes.Structure):
    _fields_ = [("router", _Matrix), ("gate_up", POINTER(_Matrix)), ("down", POINTER(_Matrix)),
                ("experts", c_int32), ("top_k", c_int32), ("inter", c_int32), ("renormalize", c_int32),
                ("topk_first", c_int32), ("router_bias", c_void_p), ("gate_up_bias", c_void_p),
                ("down_bias", c_void_p), ("alpha", c_float), ("limit", c_float), ("grouped", c_int32),
                ("sigmoid", c_int32), ("n_group", c_int32), ("topk_group", c_int32), ("group_top2", c_int32),
                ("correction_bias", c_void_p), ("scaling", c_float), ("shared_gate_up", _Matrix),
                ("shared_down", _Matrix), ("shared_inter", c_int32), ("shared_gate", c_void_p),
                ("first_expert", c_int32), ("local_experts", c_int32)]


class _Mla(ctypes.Structure):
    _fields_ = [("q_a", _Matrix), ("q_b", _Matrix), ("q", _Matrix), ("kv_a", _Matrix), ("q_a_bias", c_void_p),
                ("kv_a_bias", c_void_p), ("q_a_norm", c_void_p), ("kv_a_norm", c_void_p), ("kv_b", c_void_p),
                ("q_lora", c_int32), ("kv_lora", c_int32), ("nope", c_int32), ("rope", c_int32), ("v_dim", c_int32),
                ("interleave", c_int32), ("latent_eps", c_float), ("scale", c_float)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Matrix), ("o", _Matrix), ("gate_up", _Matrix), ("down", _Matrix),
                ("lora_qkv", _Lora), ("lora_o", _Lora), ("lora_gate_up", _Lora), ("lora_down", _Lora),
                ("input_norm", c_void_p), ("post_norm", c_void_p), ("qkv_bias", c_void_p), ("q_norm", c_void_p),
                ("k_norm", c_void_p), ("k_cache", c_void_p), ("v_cache", c_void_p), ("window", c_int64),
                ("attn_out_norm", c_void_p), ("mlp_out_norm", c_void_p), ("rope", c_int32),
                ("moe", POINTER(_Moe)), ("o_bias", c_void_p), ("sinks", c_void_p), ("mla", POINTER(_Mla))]


class _Model(ctypes.Structure):
    _fields_ = [("layers", c_int32), ("hidden", c_int32), ("inter", c_int32), ("heads", c_int32),
                ("kv_heads", c_int32), ("head_dim", c_int32), ("block_size", c_int32), ("eps", c_float),
                ("scale", c_float), ("s_block", c_int64), ("s_slot", c_int64), ("s_head", c_int64),
                ("final_norm", c_void_p), ("layer", POINTER(_Layer)), ("reduce", c_void_p), ("act", c_int32),
                ("kv_bf16", c_int32)]

# the MLP gates the C step computes (pd_model.act)
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


# int reduce(float *buf, int64_t n): the C step's all-reduce callback (pd_reduce)
_REDUCE = ctypes.CFUNCTYPE(ctypes.c_int, c_void_p, c_int64)


@dataclass
class DecodeMoE:
    """A layer's experts (pdserve.models.moe's SparseMoE routed by softmax_topk, or topk_softmax
    where topk_first is set): the router's and each expert's matrices as native_gemv.matrix_args
    gives them, the router's and the experts' float32 biases where they have them (gpt-oss, whose
    experts' clamped SwiGLU takes alpha and limit; limit 0: SiLU), and where the layer has one, the
    shared expert's matrices and its gate's weight [hidden] (Qwen2-MoE)."""
    router: tuple
    gate_up: list[tuple]
    down: list[tuple]
    top_k: int
    inter: int
    renormalize: bool
    topk_first: bool = False
    router_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    alpha: float = 0.0
    limit: float = 0.0
    # DeepSeek's routing (pdserve.models.moe.grouped_topk) where grouped is set, with its arguments
    grouped: bool = False
    sigmoid: bool = False
    n_group: int = 1
    topk_group: int = 1
    group_top2: bool = False
    correction_bias: torch.Tensor | None = None
    scaling: float = 1.0
    shared_gate_up: tuple | None = None
    shared_down: tuple | None = None
    shared_inter: int = 0
    shared_gate: torch.Tensor | None = None
    # this rank's experts are [first_expert, first_expert + len(gate_up)) of the router's rows
    # (expert parallelism; else all of them); gate_up, down and the experts' biases are theirs
    first_expert: int = 0

    def vectors(self) -> list[torch.Tensor]:
        return [t for t in (self.router_bias, self.gate_up_bias, self.down_bias, self.shared_gate,
                            self.correction_bias) if t is not None]

    def struct(self) -> tuple[_Moe, tuple]:
        """The C struct, and the arrays it points into (the caller keeps them)."""
        gate_up = (_Matrix * len(self.gate_up))(*map(_Matrix.of, self.gate_up))
        down = (_Matrix * len(self.down))(*map(_Matrix.of, self.down))
        shared = [_Matrix.of(m) for m in (self.shared_gate_up, self.shared_down)]
        biases = [_pointer(t) for t in (self.router_bias, self.gate_up_bias, self.down_bias)]
        moe = _Moe(_Matrix.of(self.router), gate_up, down, self.router[1], self.top_k, self.inter,
                   int(self.renormalize), int(self.topk_first), *biases, self.alpha, self.limit, int(self.grouped),
                   int(self.sigmoid), self.n_group, self.topk_group, int(self.group_top2),
                   _pointer(self.correction_bias), self.scaling, *shared, self.shared_inter, _pointer(self.shared_gate),
                   self.first_expert, len(self.gate_up))
        return moe, (gate_up, down)


@dataclass
class DecodeMLA:
    """A DeepSeek layer's latent attention (pdserve.models.mla.MLAttention): its matrices as
    native_gemv.matrix_args gives them (q_a and q_b, or q where q_lora is 0; kv_a), and float32:
    the biases where it has them, the two latent norms' weights and kv_b_proj's weight whole."""
    q_a: tuple | None
    q_b: tuple | None
    q: tuple | None
    kv_a: tuple
    q_a_bias: torch.Tensor | None
    kv_a_bias: torch.Tensor | None
    q_a_norm: torch.Tensor | None
    kv_a_norm: torch.Tensor
    kv_b: torch.Tensor
    q_lora: int
    kv_lora: int
    nope: int
    rope: int
    v_dim: int
    interleave: bool
    latent_eps: float
    scale: float

    def vectors(self) -> list[torch.Tensor]:
        return [t for t in (self.q_a_bias, self.kv_a_bias, self.q_a_norm, self.kv_a_norm, self.kv_b) if t is not None]

    def struct(self) -> _Mla:
        matrices = [_Matrix.of(m) for m in (self.q_a, self.q_b, self.q, self.kv_a)]
        vectors = [_pointer(t) for t in (self.q_a_bias, self.kv_a_bias, self.q_a_norm, self.kv_a_norm, self.kv_b)]
        return _Mla(*matrices, *vectors, self.q_lora, self.kv_lora, self.nope, self.rope, self.v_dim,
                    int(self.interleave), self.latent_eps, self.scale)


@dataclass
class DecodeLayer:
    """One layer's arrays: each matrix as native_gemv.matrix_args gives it, the two norms'
    float32 weights, and the layer's sliding window (0: full attention); where the layer has them,
    the qkv projection's bias (Qwen2) and the per-head norms of q and k (Qwen3), float32."""
    qkv: tuple
    o: tuple
    gate_up: tuple
    down: tuple
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    window: int
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    # Each matrix's LoRA slots (pdserve.lora.slots.LoRALayerSlots, qkv, o, gate_up, down order),
    # or None: the engine serves no adapters.
    loras: tuple | None = None
    # Gemma 3: the norms of the attention and MLP outputs (float32), and which of the step's RoPE
    # tables the layer takes
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    rope: int = 0
    moe: DecodeMoE | None = None  # the layer's experts; gate_up and down are then None
    o_bias: torch.Tensor | None = None  # gpt-oss: the o projection's bias, and its heads' sinks [heads]
    sinks: torch.Tensor | None = None
    mla: DecodeMLA | None = None  # DeepSeek's latent attention; qkv is then None

    def unfit(self) -> str | None:
        """Why the compiled step cannot read these arrays, or None."""
        optional = (self.qkv_bias, self.q_norm, self.k_norm, self.attn_out_norm, self.mlp_out_norm, self.o_bias,
                    self.sinks, *(self.moe.vectors() if self.moe is not None else ()),
                    *(self.mla.vectors() if self.mla is not None else ()))
        vectors = [self.input_norm, self.post_norm] + [t for t in optional if t is not None]
        if not all(float32_on_cpu(t) for t in vectors):
            return "a norm's weight, a bias or the sinks are not float32 on CPU"
        if (self.attn_out_norm is None) != (self.mlp_out_norm is None):
            return "only one of the attention and MLP outputs is normed"
        stacks = [t for slots in self.loras or () if slots is not None for t in (slots.a_stack, slots.b_stack)]
        if not all(float32_on_cpu(t) for t in stacks):
            return "the LoRA slots are not float32 on CPU"
        if (self.q_norm is None) != (self.k_norm is None):
            return "only one of q and k is normed"
        if self.moe is not None and self.loras is not None:
            return "a layer with experts serves no LoRA here"
        return None


@dataclass
class DecodeWeights:
    """What the compiled step reads of a model: a Llama-family decoder whose every layer is a
    plain pre-norm attention and SiLU MLP. A model that fits declares it (the model runner asks
    plan_for, which asks the model's native_decode_weights)."""
    layers: list[DecodeLayer]
    final_norm: torch.Tensor
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scale: float
    # The rank group (pdserve.layers.parallel.TPGroup: its all_reduce) at TP > 1, else None.
    tp_group: object = None
    activation: str = "silu"  # the MLP's gate: a key of ACTIVATIONS
    rope_dim: int = 0  # the RoPE tables' width where it is not head_dim (MLA's qk_rope_head_dim)


class DeclaresNativeDecode(Protocol):
    def native_decode_weights(self) -> DecodeWeights | str:
        """The model's arrays for the compiled step, or why it cannot take it."""


def _pointer(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def _cache_unfit(layer_caches, planes_per_layer: int) -> str | None:
    k0 = layer_caches[0][0]
    # bf16 planes (--kv-cache-dtype bfloat16) for K and V; MLA's latent stays float32
    dtypes = (torch.float32, torch.bfloat16) if planes_per_layer == 2 else (torch.float32,)
    if any(len(planes) != planes_per_layer or not all(p.dtype == k0.dtype and p.device.type == "cpu" and p.dim() == 4
                                       and p.stride() == k0.stride() and p.stride(-1) == 1 for p in planes)
           for planes in layer_caches) or k0.dtype not in dtypes:
        return "the KV cache is not a float32 (or bf16) K and V, or MLA's float32 latent, per layer on CPU"
    return None


class NativeDecode:
    """The compiled decode step for one model over one KV cache."""

    def __init__(self, lib: ctypes.CDLL, weights: DecodeWeights,
                 layer_caches: list[tuple[torch.Tensor, torch.Tensor]], lora_batch=None):
        """lora_batch: the runner's pdserve.lora.slots.LoRABatch (each step's adapter rows), or
        None when the engine serves no adapters."""
        self.lib, self.layer_caches, self.lora_batch = lib, layer_caches, lora_batch
        self.weights = weights  # (holds the arrays the C structs point into)
        w = weights
        self._keep: list = []  # the MoE structs and expert arrays the layer structs point into
        self._layers = (_Layer * len(w.layers))(*(self._layer(layer, caches)
                                                   for layer, caches in zip(w.layers, layer_caches)))
        k0 = layer_caches[0][0]
        self._reduce, self._reduce_error = None, None
        if w.tp_group is not None:  # (the ctypes callback must live as long as the struct)
            self._reduce = _REDUCE(self._all_reduce)
        self._model = _Model(len(w.layers), w.hidden, w.inter, w.heads, w.kv_heads, w.head_dim, k0.shape[1], w.eps,
                             w.scale, *k0.stride()[:3], w.final_norm.data_ptr(), self._layers,
                             ctypes.cast(self._reduce, c_void_p) if self._reduce else None,
                             ACTIVATIONS[w.activation], int(k0.dtype == torch.bfloat16))
        self.rope_tables = 1 + max(layer.rope for layer in w.layers)
        self._model_ptr = ctypes.addressof(self._model)
        self.steps = self.rows = 0  # steps and rows run here (tests check the path is taken)

    def _all_reduce(self, address: int, count: int) -> int:
        """The C step's callback: the rank group's all-reduce of `count` floats at `address`, in
        place. A failure (a lost peer) is kept for forward to raise: it cannot cross C."""
        try:
            self.weights.tp_group.all_reduce(torch.frombuffer((c_float * count).from_address(address),
                                                              dtype=torch.float32))
            return 0
        except BaseException as exc:  # noqa: BLE001 (re-raised by forward once C has returned)
            self._reduce_error = exc
            return -3

    def _layer(self, layer: DecodeLayer, caches: tuple[torch.Tensor, torch.Tensor]) -> _Layer:
        matrices = [_Matrix.of(m) for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        loras = [_Lora.of(slots) for slots in layer.loras or (None,) * 4]
        optional = [_pointer(t) for t in (layer.qkv_bias, layer.q_norm, layer.k_norm)]
        moe = mla = None
        if layer.moe is not None:
            moe, arrays = layer.moe.struct()
            self._keep.append((moe, arrays))  # the layer struct points into them
        if layer.mla is not None:
            mla = layer.mla.struct()
            self._keep.append(mla)
        return _Layer(*matrices, *loras, layer.input_norm.data_ptr(), layer.post_norm.data_ptr(), *optional,
                      caches[0].data_ptr(), caches[-1].data_ptr(), layer.window, _pointer(layer.attn_out_norm),
                      _pointer(layer.mlp_out_norm), layer.rope, ctypes.pointer(moe) if moe is not None else None,
                      _pointer(layer.o_bias), _pointer(layer.sinks), ctypes.pointer(mla) if mla is not None else None)

    def takes(self, x: torch.Tensor, ctx) -> bool:
        """A step of decode rows only (one-token queries, verify rows), not too many, over this
        plan's cache."""
        meta, tokens = ctx.meta, x.shape[0]
        return (tokens <= MAX_STEP_TOKENS and meta.num_decodes == tokens
                and meta.decode_context_lens.shape[0] == tokens and x.dtype == torch.float32
                and ctx.layer_caches is self.layer_caches
                and (self.lora_batch is None or sum(n for _, n in self.lora_batch.step_rows) == tokens))

    def _row_slots(self, tokens: int) -> torch.Tensor | None:
        """Each row's LoRA slot (-1: the base model), or None when no row of the step has one."""
        if self.lora_batch is None or all(slot < 0 for slot, _ in self.lora_batch.step_rows):
            return None
        return torch.tensor(self.lora_batch.row_slots(), dtype=torch.int32)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        """The final norm's output [T, hidden] for the embedded tokens x [T, hidden]; cos, sin as
        RotaryEmbedding.cos_sin gives them, or [tables, T, ...] stacked where the layers take
        several tables (DecodeLayer.rope). The step's K and V go into the cache."""
        meta, tokens = ctx.meta, x.shape[0]
        x = x.contiguous()
        h = torch.empty_like(x)
        shape = (self.rope_tables, tokens, self.weights.rope_dim or self.weights.head_dim)
        cos, sin = cos.reshape(shape).contiguous(), sin.reshape(shape).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        tables = meta.decode_block_tables.to(torch.int32).contiguous()
        lens = meta.decode_context_lens.to(torch.int32).contiguous()
        row_slots = self._row_slots(tokens)
        rc = self.lib.pd_decode_layers(self._model_ptr, x.data_ptr(), tokens, cos.data_ptr(), sin.data_ptr(),
                                       slots.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(),
                                       row_slots.data_ptr() if row_slots is not None else None,
                                       h.data_ptr(), numba.get_num_threads())
        if self._reduce_error is not None:
            error, self._reduce_error = self._reduce_error, None
            raise error
        if rc != 0:
            raise RuntimeError(f"native decode step failed ({rc})")
        self.steps += 1
        self.rows += tokens
        return h


def plan_for(model: DeclaresNativeDecode, layer_caches: list[tuple[torch.Tensor, ...]], device: torch.device,
             lora_batch=None) -> NativeDecode | None:
    """The compiled decode step for this model and cache, or None (the layers run in Python),
    with one log line saying why when the library is there but the model does not fit it."""
    if device.type != "cpu":
        return None
    lib = native_gemv.library()
    if lib is None:
        return None
    weights = model.native_decode_weights()
    reason = weights if isinstance(weights, str) else _cache_unfit(layer_caches, 1 if weights.layers[0].mla else 2)
    if reason is not None:
        log.info("compiled decode step off: %s", reason)
        return None
    return NativeDecode(lib, weights, layer_caches, lora_batch)
