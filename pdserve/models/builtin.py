"""The built-in model: a tiny Llama with weights drawn from a fixed seed and a byte-level
tokenizer, materialised once into a cache directory and then loaded like any checkpoint.

numpy's PCG64 generator is stable across versions and machines, so every process of a cluster
builds bit-identical weights (and so identical block keys and KV) without shipping a file.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from pdserve.cache_dir import cache_root

BUILTIN_MODELS = {
    "builtin:tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
                         tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-5),
}
_VERSION = "v1"
_SEED = 20261122
_INIT_STD = 0.2  # large enough that greedy decoding has clear winners
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def ensure_builtin_model(name: str) -> Path:
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {name!r}; available: {', '.join(BUILTIN_MODELS)}")
    target = cache_root() / f"{name.replace(':', '-')}-{_VERSION}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    try:
        write_builtin_model(staging, BUILTIN_MODELS[name])
        _make_readable(staging)  # mkdtemp is private; the cache is shared by every user's nodes
        os.rename(staging, target)
    except OSError:
        if not (target / "model.safetensors").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _make_readable(path: Path) -> None:
    path.chmod(0o755)
    for f in path.iterdir():
        f.chmod(0o644)


def write_builtin_model(path: Path, dims: dict) -> None:
    # deferred: torch, for writing the weights only; the torch-free router imports this module through model_path
    import torch
    from safetensors.torch import save_file  # torch, as above
    from transformers import LlamaConfig  # deferred: transformers takes seconds to import

    tokenizer = build_byte_tokenizer()
    dims = {**dims, "vocab_size": len(tokenizer)}
    config = LlamaConfig(**dims, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         architectures=["LlamaForCausalLM"])
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    rng = np.random.default_rng(_SEED)
    tensors = {name: torch.from_numpy(_init(rng, name, shape)) for name, shape in _weight_shapes(dims)}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def _init(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name.endswith("norm.weight"):
        return np.ones(shape, dtype=np.float32)
    return (rng.standard_normal(shape, dtype=np.float32) * _INIT_STD).astype(np.float32)


def _weight_shapes(d: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, i, v = d["hidden_size"], d["intermediate_size"], d["vocab_size"]
    hd = h // d["num_attention_heads"]
    q, kv = d["num_attention_heads"] * hd, d["num_key_value_heads"] * hd
    shapes = [("model.embed_tokens.weight", (v, h)), ("model.norm.weight", (h,))]
    for n in range(d["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes += [(p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                   (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
                   (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                   (p + "mlp.down_proj.weight", (h, i)), (p + "input_layernorm.weight", (h,)),
                   (p + "post_attention_layernorm.weight", (h,))]
    return shapes


def build_byte_tokenizer(extra_special_tokens: tuple[str, ...] = (), chat_template: str = CHAT_TEMPLATE,
                         named_tokens: dict[str, str] | None = None):
    """A byte-level tokenizer with no merges: every byte is a token, so any text round-trips.
    extra_special_tokens follow the standard ones (a vision model's image tokens); named_tokens
    gives some of them the attribute names a processor reads (Gemma 3's tokenizer.boi_token)."""
    from transformers import PreTrainedTokenizerFast  # deferred: transformers takes seconds to import

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    specials = [*SPECIAL_TOKENS, *extra_special_tokens]
    for tok in specials:
        vocab[tok] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=SPECIAL_TOKENS[0],
                                   eos_token=SPECIAL_TOKENS[1], chat_template=chat_template,
                                   **({"extra_special_tokens": named_tokens} if named_tokens else {}))
