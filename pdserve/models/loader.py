"""Load a Llama-family model from a local Hugging Face directory (config.json + safetensors)."""
from __future__ import annotations

import importlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.kernels.fp8_kv import is_kv_scale
from pdserve.kernels.host_memory import weights_in_huge_pages
from pdserve.layers.loading import load_param, materialize, process_weights_after_loading
from pdserve.layers.quant import fp8_block, gptq_awq
from pdserve.layers.quant.base import quantization_dict
from pdserve.layers.quant.compressed_tensors import SUPPORTED, CompressedTensorsConfig, grouped_tensors
from pdserve.layers.quant.gguf_config import GGUFQuantConfig
from pdserve.layers.quant.grouped import GroupedWeight
from pdserve.models import qwen2_5_vl
from pdserve.models.config_snapshot import load_snapshot, save_snapshot
from pdserve.models.gguf import VIEW_MARKER, gguf_tensor_types, gguf_tensors, is_gguf_view
from pdserve.models.llama import LlamaModel, ModelSpec, layer_windows

# resolve_model_path is the loader's public API too (callers that load a model import it here).
from pdserve.models.model_path import ModelLoadError, resolve_model_path  # noqa: F401
from pdserve.models.mrope import MRotaryEmbedding
from pdserve.models.rope import RotaryEmbedding

# Families with a model module of their own: architecture -> module exposing
# check_config(config) (ValueError naming what it cannot run) and
# build_model(config, files, dtype, device). Imported only when such a checkpoint is loaded.
FAMILY_MODULES = {
    "Qwen3MoeForCausalLM": "pdserve.models.qwen_moe",
    "Qwen2MoeForCausalLM": "pdserve.models.qwen_moe",
    "MixtralForCausalLM": "pdserve.models.qwen_moe",
    "DeepseekV2ForCausalLM": "pdserve.models.deepseek",
    "DeepseekV3ForCausalLM": "pdserve.models.deepseek",
    "Gemma3ForCausalLM": "pdserve.models.gemma3",
    "Gemma3ForConditionalGeneration": "pdserve.models.gemma3_vl",
    "GptOssForCausalLM": "pdserve.models.gpt_oss",
    "Qwen3_5ForCausalLM": "pdserve.models.qwen3_5",
    "Qwen3_5ForConditionalGeneration": "pdserve.models.qwen3_5_vl",
    "Qwen3NextForCausalLM": "pdserve.models.qwen3_next",
    "NemotronHForCausalLM": "pdserve.models.nemotron_h",
    "GraniteMoeHybridForCausalLM": "pdserve.models.granite_hybrid",
    "FalconH1ForCausalLM": "pdserve.models.falcon_h1",
}
# Vision-language models: the config's text_config is what the engine reads
# (flatten_multimodal_config). Qwen2.5-VL's language model loads as a Llama-family model, the
# tower attached after; Gemma 3's and Qwen3.5's have family modules (above) that load their towers.
MULTIMODAL_ARCHITECTURES = (qwen2_5_vl.ARCHITECTURE, "Gemma3ForConditionalGeneration",
                            "Qwen3_5ForConditionalGeneration")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           *MULTIMODAL_ARCHITECTURES, *FAMILY_MODULES)


def load_hf_config(path: Path):
    # A plain config transformers resolved before is read back without its config classes
    # (about 1 s of CPU a process: pdserve.models.config_snapshot).
    config = load_snapshot(path)
    if config is None:
        # deferred: transformers takes seconds to import, and not every importer reads a config (eagle, mtp)
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(str(path))
        save_snapshot(path, config)
    archs = getattr(config, "architectures", None) or []
    if archs and archs[0] in MULTIMODAL_ARCHITECTURES:
        config = flatten_multimodal_config(config)
    if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"architecture {archs or 'unknown'} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if archs[0] in FAMILY_MODULES:
        try:
            _family(archs[0]).check_config(config)
        except ValueError as exc:
            raise ModelLoadError(f"{path}: {exc}") from None
    quantization = quantization_dict(config)
    if quantization and not (archs[0] in FAMILY_MODULES and getattr(_family(archs[0]), "LOADS_QUANTIZED", False)):
        _checkpoint_quant_config(path, archs[0], quantization)  # refuses what cannot load, now
    return config


def flatten_multimodal_config(config):
    """The language model's config, standing for the whole model: the engine reads layers, heads
    and context length from it as from a text model's. It keeps the model's architecture and
    tied embeddings, and the whole config as multimodal_config (the tower's and the image
    token's settings)."""
    text = config.get_text_config()
    text.architectures = list(config.architectures)
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    text.multimodal_config = config
    return text


def _checkpoint_quant_config(path: Path, arch: str, quantization: dict):
    """The QuantConfig of a checkpoint's quantization_config (Llama family: compressed-tensors, FP8
    blocks, GPTQ, AWQ)."""
    method = quantization.get("quant_method")
    if arch in FAMILY_MODULES or method not in ("compressed-tensors", "fp8", *gptq_awq.METHODS):
        raise ModelLoadError(f"{path}: quantized checkpoints ({method}) load for the Llama family "
                             f"({', '.join(a for a in SUPPORTED_ARCHITECTURES if a not in FAMILY_MODULES)}) "
                             f"in compressed-tensors {SUPPORTED}, as FP8 blocks ({fp8_block.SUPPORTED}), "
                             f"or {gptq_awq.SUPPORTED}, "
                             f"and for DeepSeek-V2/V3 as FP8 blocks; this one is a {method} {arch}")
    try:
        if method == "fp8":
            return fp8_block.Fp8BlockConfig(quantization, fp8_block.fp8_modules(safetensors_files(path)))
        if method in gptq_awq.METHODS:
            return gptq_awq.GptqAwqConfig(quantization)
        return CompressedTensorsConfig(quantization)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None


def _family(arch: str):
    return importlib.import_module(FAMILY_MODULES[arch])


def spec_from_config(config) -> ModelSpec:
    arch = config.architectures[0]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention_bias = bool(getattr(config, "attention_bias", False))
    return ModelSpec(
        architecture=arch, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim, rms_norm_eps=config.rms_norm_eps,
        qkv_bias=arch in ("Qwen2ForCausalLM", qwen2_5_vl.ARCHITECTURE) or attention_bias,
        o_bias=arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM") and attention_bias,
        qk_norm=arch == "Qwen3ForCausalLM",
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_position_embeddings=config.max_position_embeddings,
        hidden_act=getattr(config, "hidden_act", "silu"),
        layer_windows=layer_windows(config),
    )


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ModelLoadError(f"{path} is missing weight shards: {', '.join(missing)}")
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weights")
    return files


def load_model(path: Path, config, dtype: torch.dtype, device: torch.device, vision_tower: bool = True) -> LlamaModel:
    """vision_tower False: a vision-language model's language model only (a TP worker, which
    takes its embeddings from rank 0). On CPU the weights end in huge pages (host_memory)."""
    model = _build_and_load(path, config, dtype, device, vision_tower)
    if device.type == "cpu":
        weights_in_huge_pages([*model.parameters(), *model.buffers()])
    return model


def _build_and_load(path: Path, config, dtype: torch.dtype, device: torch.device, vision_tower: bool):
    if config.architectures[0] in FAMILY_MODULES:
        # A GGUF checkpoint is handed over as its view's marker file, which checkpoint_tensors reads.
        files = [path / VIEW_MARKER] if is_gguf_view(path) else safetensors_files(path)
        model = _family(config.architectures[0]).build_model(config, files, dtype, device)
        if not vision_tower and getattr(model, "visual", None) is not None:
            model.visual = None  # (a TP worker: rank 0 encodes and sends the embeddings)
        return model
    spec = spec_from_config(config)
    multimodal = config.architectures[0] == qwen2_5_vl.ARCHITECTURE
    rope = (MRotaryEmbedding if multimodal else RotaryEmbedding)(config, spec.head_dim, spec.max_position_embeddings)
    quant_config = _quant_config(path, device, config)
    with torch.device("meta"):
        if multimodal:
            model = qwen2_5_vl.Qwen2_5_VLModel(spec, rope, config.multimodal_config, quant_config)
        else:
            model = LlamaModel(spec, rope, quant_config)
    model = materialize(model)
    if spec.tie_word_embeddings:
        model.lm_head.tie_to(model.embed_tokens)
    if is_gguf_view(path):
        kept = frozenset(quant_config.kept) if quant_config is not None else frozenset()
        _place_all(model, spec, gguf_tensors(path, kept))
    elif quant_config is not None:
        _place_all(model, spec, _quantized_tensors(quant_config, _safetensors_tensors(safetensors_files(path))))
    else:
        _load_weights(model, spec, safetensors_files(path))
    process_weights_after_loading(model)
    model.rope = rope.to(device)
    model = model.to(device=device, dtype=dtype).eval()
    if multimodal and vision_tower:
        model.attach_tower(config.multimodal_config, safetensors_files(path), dtype, device)
    return model


def _quant_config(path: Path, device: torch.device, config):
    """The checkpoint's quantization scheme; None: full precision. A quantization_config's
    weights stay quantized on CPU and on CUDA (whose linear layers take the Triton and
    torch._scaled_mm kernels, pdserve.layers.quant.cuda_kernels, and whose quantized MoE experts
    take grouped Triton GEMMs, pdserve.models.moe_quant). GGUF blocks of the kept types stay
    quantized on both, in the same grouped format (on CUDA, the Triton grouped GEMM)."""
    quantization = quantization_dict(config)
    if quantization:
        return _checkpoint_quant_config(path, config.architectures[0], quantization)
    if is_gguf_view(path):
        return GGUFQuantConfig(gguf_tensor_types(path))
    return None


def _quantized_tensors(quant_config, tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, object]]:
    if isinstance(quant_config, fp8_block.Fp8BlockConfig):
        return fp8_block.fp8_block_tensors(tensors, quant_config.block, lambda module: True)
    if isinstance(quant_config, gptq_awq.GptqAwqConfig):
        return gptq_awq.gptq_awq_tensors(tensors, quant_config)
    return grouped_tensors(tensors, quant_config)


def _load_weights(model: LlamaModel, spec: ModelSpec, files: list[Path]) -> None:
    _place_all(model, spec, _safetensors_tensors(files))


def _safetensors_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _place_all(model: LlamaModel, spec: ModelSpec, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in tensors:
        loaded.update(_place(name, tensor, model, params, spec))
    expected = {n for n in params if not (spec.tie_word_embeddings and n.startswith("lm_head."))}
    missing = sorted(expected - loaded)
    if missing:
        raise ModelLoadError(f"checkpoint is missing weights: {', '.join(missing[:8])}"
                             + (" ..." if len(missing) > 8 else ""))


_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def _place(name: str, tensor, model: LlamaModel, params: dict, spec: ModelSpec) -> list[str]:
    """Copy one checkpoint tensor into its (possibly fused) parameters; returns the parameters
    complete once it is in (a fused one counts when its last part arrives). A quantized tensor
    (GroupedWeight) fills its layer's packed weights, scales and mins."""
    if qwen2_5_vl.is_tower_weight(name):  # a vision tower's: attached after (Qwen2_5_VLModel.attach_tower)
        return []
    name = name.removeprefix("model.") if not name.startswith("lm_head") else name
    if "rotary_emb" in name or is_kv_scale(name):  # KV scales: see pdserve.kernels.fp8_kv
        return []
    parts = name.split(".")
    shard, last = None, True
    for i, part in enumerate(parts):
        if part in _FUSED:
            fused, shard = _FUSED[part]
            last = shard == (2 if fused == "qkv_proj" else 1)
            name = ".".join(parts[:i] + [fused] + parts[i + 1:])
            break
    if name not in params and not isinstance(tensor, GroupedWeight):
        if name == "lm_head.weight" and spec.tie_word_embeddings:
            return []
        raise ModelLoadError(f"unexpected weight {name!r} in checkpoint")
    if isinstance(tensor, GroupedWeight):
        prefix = name.rpartition(".")[0]
        values = tensor.to_params(model.get_submodule(prefix).quant_method.fmt)
        targets = {f"{prefix}.{param}": value for param, value in values.items()}
    else:
        targets = {name: tensor}
    for target, value in targets.items():
        load_param(model, target, value, shard)
    return list(targets) if last else []


def default_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"dtype {name!r} is not supported; supported: auto, {', '.join(dtypes)}")
    if device.type == "cpu" and name == "float16":
        raise ValueError("float16 is not supported on CPU; use float32 or bfloat16")
    return dtypes[name]
