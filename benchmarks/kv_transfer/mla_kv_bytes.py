"""KV cache bytes per token: pdserve's MLA latent layout against a K/V-per-head cache of the
same model (K: qk_nope_head_dim + qk_rope_head_dim per head, V: v_head_dim per head).

    python -m benchmarks.kv_transfer.mla_kv_bytes [--dtype bfloat16]

The shapes are transformers' DeepseekV3Config and DeepseekV2Config defaults (DeepSeek-V3/R1
and DeepSeek-V2) and DeepSeek-V2-Lite's published config; no weights are needed. The latent
column is what pdserve's engine allocates (KVLayout.for_model), so it is also what one block
handover moves over NIXL or through the store, per token.
"""
from __future__ import annotations

import argparse

import torch
from transformers import DeepseekV2Config, DeepseekV3Config

from pdserve.kvstore.layout import KVLayout

MODELS = {
    "DeepSeek-V3 / R1": lambda: DeepseekV3Config(),
    "DeepSeek-V2": lambda: DeepseekV2Config(num_hidden_layers=60, num_attention_heads=128, kv_lora_rank=512,
                                            qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128),
    "DeepSeek-V2-Lite": lambda: DeepseekV2Config(num_hidden_layers=27, num_attention_heads=16, q_lora_rank=None,
                                                 kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                                                 v_head_dim=128),
}


def per_token_bytes(config, dtype: torch.dtype) -> tuple[int, int]:
    """(latent layout, K/V per head) bytes per token over all layers."""
    layout = KVLayout.for_model(config, block_size=1, dtype=dtype, model_name="x")
    per_head = config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)
    return layout.block_nbytes(1), config.num_hidden_layers * per_head * dtype.itemsize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    dtype = getattr(torch, parser.parse_args().dtype)
    print("| model | layers | heads | latent values/token/layer | latent KiB/token | K/V-per-head KiB/token | ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, make in MODELS.items():
        config = make()
        latent, per_head = per_token_bytes(config, dtype)
        print(f"| {name} | {config.num_hidden_layers} | {config.num_attention_heads} "
              f"| {config.kv_lora_rank + config.qk_rope_head_dim} | {latent / 1024:.1f} "
              f"| {per_head / 1024:.1f} | {per_head / latent:.1f}x |")


if __name__ == "__main__":
    main()
