"""The ~32M-parameter Llama the CPU benchmarks share (hidden 512, 8 layers, 8 heads, 4 KV heads,
vocab 8192, float32, random weights), the KV cache the offline runs give it, and their workload."""
from __future__ import annotations

import random
from pathlib import Path

CONFIG = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=4, vocab_size=8192, max_position_embeddings=2048, tie_word_embeddings=False)
KV_BLOCKS, BLOCK_TOKENS = 2560, 16  # pdserve's KV cache; transformers' gets the same token capacity


def build_model(root: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG, architectures=["LlamaForCausalLM"]))
    model.save_pretrained(root)
    return root


def build_served_model(root: Path) -> Path:
    """The same shape with 4096 positions and the byte tokenizer, for a served cluster."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from pdserve.models.builtin import build_byte_tokenizer
    torch.manual_seed(0)
    config = LlamaConfig(**{**CONFIG, "max_position_embeddings": 4096}, architectures=["LlamaForCausalLM"])
    AutoModelForCausalLM.from_config(config).save_pretrained(root)
    build_byte_tokenizer().save_pretrained(root)
    return root


def workload(n: int, lo: int, hi: int, seed: int = 0, vocab: int = CONFIG["vocab_size"]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
