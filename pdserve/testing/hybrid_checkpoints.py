"""Random-weight checkpoints of the hybrid families (Qwen3.5 text, Nemotron-H), built offline
with transformers exactly as save_pretrained writes them, at small shapes: hidden 64, a few
heads, each layer kind at least once.

Weights use std 0.2 (as pdserve.testing.model_factory, for clear greedy winners); norms are
randomised too so each is exercised (Qwen3.5's scale by 1 + w: drawn around 0). The decays
(A_log, dt_bias) keep transformers' own initialisation.
"""
from __future__ import annotations

from pathlib import Path

import torch

from pdserve.models.builtin import build_byte_tokenizer

HYBRIDS = {
    "qwen3_5_text": ("Qwen3_5ForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_hidden_layers=4, max_position_embeddings=512, rms_norm_eps=1e-6)),
    "qwen3_next": ("Qwen3NextForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_hidden_layers=4, max_position_embeddings=512, rms_norm_eps=1e-6, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[2])),
    "granitemoehybrid": ("GraniteMoeHybridForCausalLM", dict(
        hidden_size=64, intermediate_size=32, shared_intermediate_size=48, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["mamba", "attention", "mamba", "attention"], num_hidden_layers=4,
        num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
        mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=32, position_embedding_type="rope",
        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=1.5,
        max_position_embeddings=512)),
    "nemotron_h": ("NemotronHForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention", "mlp"],
        ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, conv_kernel=4, expand=2,
        chunk_size=32, max_position_embeddings=512, layer_norm_epsilon=1e-5,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
        n_group=2, topk_group=1)),
    # every multiplier away from 1 (each one wrong or missing changes the tokens), RoPE with a
    # small base, the Mamba output through the grouped norm
    "falcon_h1": ("FalconH1ForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
        mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
        mamba_chunk_size=32, mamba_rms_norm=True, mamba_norm_before_gate=False, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0}, embedding_multiplier=1.5,
        lm_head_multiplier=0.8, mlp_multipliers=[1.2, 0.7], key_multiplier=0.6, attention_in_multiplier=1.3,
        attention_out_multiplier=0.9, ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.4], ssm_in_multiplier=0.7,
        ssm_out_multiplier=1.25)),
}


def make_hybrid_model(root: Path, kind: str, seed: int = 0, **overrides) -> Path:
    # deferred: transformers takes ~1 s to import, and tests import this module at collection
    from transformers import AutoConfig, AutoModelForCausalLM
    arch, extra = HYBRIDS[kind]
    tokenizer = build_byte_tokenizer()
    config = AutoConfig.for_model(kind, **{**extra, **overrides}, vocab_size=len(tokenizer), initializer_range=0.2,
                                  tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=0, architectures=[arch])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    zero_centred = kind in ("qwen3_5_text", "qwen3_next")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and not name.endswith("linear_attn.norm.weight"):
                p.normal_(0.0 if zero_centred else 1.0, 0.2)
            elif name.endswith("linear_attn.norm.weight") or name.endswith("mixer.norm.weight"):
                p.normal_(1.0, 0.2)  # the gated norms scale by w
            elif name.endswith("bias") and "dt_bias" not in name:
                p.normal_(0.0, 0.2)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # the MoE routing bias (Nemotron-H)
                buf.normal_(0.0, 0.05)
    path = root / kind
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load_reference(path: Path):
    # deferred: transformers takes ~1 s to import, and tests import this module at collection
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compare with ignore_eos: never stop early
    return model
