"""GGUF checkpoints of every dense architecture pdserve serves, written here the way llama.cpp's
converter writes them (Q/K rows of llama permuted, tensors renamed, weights quantized, a byte-level
BPE tokenizer and a chat template in the metadata), then loaded by pdserve and by transformers'
own GGUF path: prompt logits and greedy tokens agree, the tokenizer and chat template come from
the metadata, and the block-key salt tells two quantizations of one model apart.
"""
from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from pdserve import LLM
from pdserve.models.gguf import GGUFError, checkpoint_name, find_gguf_file, hf_tensor_name
from pdserve.models.loader import resolve_model_path
from pdserve.testing.model_factory import assert_matches_reference

Q = gguf.GGMLQuantizationType
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0)
# GGUF architecture -> transformers model type and its extra settings. transformers reads no
# head_dim for qwen3 GGUFs (Qwen3Config's default, 128, applies), so the model is built with it.
# The MoE models take transformers' defaults for the expert sizes its GGUF reader does not read
# (pdserve reads them from the file's expert_*feed_forward_length keys, written here too).
MOE = dict(num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
ARCHS = {
    "llama": ("llama", dict(tie_word_embeddings=True)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=False)),
    "qwen3": ("qwen3", dict(tie_word_embeddings=False, head_dim=128)),
    "qwen3moe": ("qwen3_moe", dict(MOE, head_dim=16, moe_intermediate_size=768, norm_topk_prob=True)),
    "qwen2moe": ("qwen2_moe", dict(MOE, moe_intermediate_size=1408, shared_expert_intermediate_size=5632)),
}
NEW_TOKENS = 12


def _vocab() -> tuple[list[str], list[str]]:
    """Byte-level BPE: the 256 byte symbols, a few merges, the chat template's special tokens."""
    tokens = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
    tokens += [m.replace(" ", "") for m in merges] + SPECIALS
    return tokens, merges


def _hf_to_gguf_name(name: str) -> str:
    inverse = {}
    for g in ("token_embd", "output_norm", "output"):
        inverse[hf_tensor_name(f"{g}.weight")] = f"{g}.weight"
    if name in inverse:
        return inverse[name]
    layer, rest = name.removeprefix("model.layers.").split(".", 1)
    for short in ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm",
                  "attn_k_norm", "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_inp", "ffn_gate_shexp",
                  "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp_shexp"):
        for suffix in ("weight", "bias"):
            if hf_tensor_name(f"blk.{layer}.{short}.{suffix}") == name:
                return f"blk.{layer}.{short}.{suffix}"
    raise KeyError(name)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (interleaved rotary pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, arch: str, qtype, seed: int = 0, expert_count: int = 0, dims: dict | None = None,
               quantize=gguf.quantize):
    """qtype: one type for every matrix, or a function of the GGUF tensor name giving its type;
    quantize(array, type) -> blocks (gguf-py's, which has no K types: tests/gguf_kquants.py does)."""
    model_type, extra = ARCHS[arch]
    tokens, merges = _vocab()
    sizes = {**DIMS, **(dims or {})}
    config = AutoConfig.for_model(model_type, vocab_size=len(tokens), initializer_range=0.2, **sizes, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"test-{arch}")
    writer.add_block_count(sizes["num_hidden_layers"])
    writer.add_context_length(sizes["max_position_embeddings"])
    writer.add_embedding_length(sizes["hidden_size"])
    writer.add_feed_forward_length(sizes["intermediate_size"])
    writer.add_head_count(sizes["num_attention_heads"])
    writer.add_head_count_kv(sizes["num_key_value_heads"])
    writer.add_rope_freq_base(sizes["rope_theta"])
    writer.add_layer_norm_rms_eps(sizes["rms_norm_eps"])
    writer.add_vocab_size(len(tokens))
    if expert_count:  # experts announced on an architecture that has none (llama.cpp's Mixtral)
        writer.add_expert_count(expert_count)
    if "num_experts" in extra:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if getattr(config, "shared_expert_intermediate_size", 0):
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if "head_dim" in extra and arch != "qwen3":
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, data in _gguf_tensors(model.state_dict(), arch, config):
        kind = qtype(name) if callable(qtype) else qtype
        if data.ndim >= 2 and data.shape[0] > 1 and kind != Q.F32:
            writer.add_tensor(name, quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_tensors(state: dict, arch: str, config):
    """(GGUF name, array) as llama.cpp's converter writes them: experts stacked per projection."""
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.float().numpy()
        if name.endswith("experts.gate_up_proj"):  # transformers' fused [E, 2 * I, H]: gate, then up
            layer = name.split(".")[2]
            half = data.shape[1] // 2
            yield f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(data[:, :half])
            yield f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(data[:, half:])
            continue
        if name.endswith("experts.down_proj"):
            yield f"blk.{name.split('.')[2]}.ffn_down_exps.weight", data
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = DIMS["num_attention_heads"] if "q_proj" in name else DIMS["num_key_value_heads"]
            data = _permute(data, heads)
        if name.endswith("shared_expert_gate.weight"):
            data = data.reshape(-1)  # llama.cpp stores the [1, hidden] gate as a vector
        yield _hf_to_gguf_name(name), data


def reference(path):
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return tok, model.eval()


@pytest.fixture(autouse=True)
def _private_cache(private_cache):
    """conftest's: a private PDSERVE_CACHE_DIR sharing the compiled kernels"""


@pytest.mark.parametrize("arch,qtype", [("llama", Q.Q8_0), ("qwen2", Q.Q4_1), ("qwen3", Q.F16),
                                        ("qwen3moe", Q.Q8_0), ("qwen2moe", Q.Q4_1)])
def test_gguf_matches_transformers(tmp_path, arch, qtype):
    path = write_gguf(tmp_path / f"{arch}.{qtype.name}.gguf", arch, qtype)
    tok, ref = reference(path)
    llm = LLM(str(path), num_kv_blocks=64)
    assert_matches_reference(llm, ref, 1, (5, 17, 40), NEW_TOKENS, 1e-4, arch)
    messages = [{"role": "user", "content": "the thin tin in a hat"}]
    assert llm.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) \
        == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert llm.engine.tokenizer("the thin tin")["input_ids"] == tok("the thin tin")["input_ids"]


def test_two_quantizations_never_share_kv(tmp_path):
    q8 = write_gguf(tmp_path / "m.Q8_0.gguf", "llama", Q.Q8_0)
    q4 = write_gguf(tmp_path / "m.Q4_1.gguf", "llama", Q.Q4_1)
    names = {checkpoint_name(str(p), resolve_model_path(str(p))) for p in (q8, q4)}
    assert len(names) == 2
    # The same quantization under another path, and a directory holding it, name one checkpoint
    # content; the salt still carries the --model argument, as for any checkpoint.
    folder = tmp_path / "only"
    folder.mkdir()
    shutil.copy(q8, folder / q8.name)
    assert find_gguf_file(str(folder)) == folder / q8.name
    a, b = (checkpoint_name("m", resolve_model_path(str(p))) for p in (q8, folder))
    assert a == b and "gguf:m.Q8_0.gguf:" in a
    salts = {LLM(str(p), num_kv_blocks=8).engine.salt for p in (q8, q4)}
    assert len(salts) == 2


def test_gguf_errors_name_the_fix(tmp_path):
    (tmp_path / "mixtral").mkdir()
    write_gguf(tmp_path / "a.gguf", "llama", Q.F32)
    shutil.copy(tmp_path / "a.gguf", tmp_path / "b.gguf")
    with pytest.raises(GGUFError, match="holds 2 GGUF files"):
        find_gguf_file(str(tmp_path))
    mixtral_like = write_gguf(tmp_path / "mixtral" / "m.gguf", "llama", Q.F32, expert_count=4)
    with pytest.raises(GGUFError, match="Mixtral-style"):
        resolve_model_path(str(mixtral_like))
    bad = tmp_path / "bad" / "x.gguf"
    bad.parent.mkdir()
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a GGUF file|cannot read"):
        resolve_model_path(str(bad))
