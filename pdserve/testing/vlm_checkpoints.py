"""Random-weight vision-language checkpoints for tests and benchmarks, built offline with
transformers: the smallest towers that still exercise every path (window and full attention,
the patch merger, M-RoPE), with a byte tokenizer that knows the image tokens and a chat template
that places them, and the model's own image processor saved beside them."""
from __future__ import annotations

from pathlib import Path

import torch

from pdserve.models.builtin import SPECIAL_TOKENS, build_byte_tokenizer

QWEN_VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
# Content parts: text as is, each image as Qwen's vision_start, image_pad, vision_end.
QWEN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] }}{% else %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
# Small enough that a test image is tens of tokens: 56x56 to 224x224 pixels.
QWEN_PROCESSOR = dict(min_pixels=56 * 56, max_pixels=224 * 224)


def _save_random(model_class, config, seed: int, tokenizer, path: Path) -> Path:
    """The model with random weights, saved with its tokenizer: std 0.2 around 0, norms around 1
    (clear greedy winners, see model_factory)."""
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.2)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_qwen2_5_vl(root: Path, seed: int = 0, vision_overrides: dict | None = None) -> Path:
    """vision_overrides: keys merged into the vision config (a bigger tower for benchmarks);
    None keeps the tests' smallest one."""
    # deferred: transformers takes seconds to import, and tests import this module at collection
    import transformers
    tokenizer = build_byte_tokenizer(QWEN_VISION_TOKENS, QWEN_CHAT_TEMPLATE)
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in QWEN_VISION_TOKENS}
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           fullatt_block_indexes=[1], window_size=56, spatial_merge_size=2, patch_size=14,
                           temporal_patch_size=2) | (vision_overrides or {}),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    path = _save_random(transformers.Qwen2_5_VLForConditionalGeneration, config, seed, tokenizer, root / "qwen2_5_vl")
    transformers.Qwen2VLImageProcessorPil(**QWEN_PROCESSOR).save_pretrained(path)
    return path


def load_qwen2_5_vl_reference(path: Path):
    # deferred: transformers, for the reference model only
    import transformers
    return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        str(path), torch_dtype=torch.float32, attn_implementation="eager").eval()



def make_qwen3_5_vl(root: Path, seed: int = 0) -> Path:
    """Qwen3.5 with images: the hybrid text model of pdserve.testing.hybrid_checkpoints (Gated
    DeltaNet and gated attention layers, partial RoPE) under a 2-block tower with a 4x4 learned
    position grid. So that a wrong position shows in the tokens: mrope_section [4, 2, 2] over
    the 8 rotary frequencies with rope_theta 10 (every frequency turns within an image's few
    rows), and the patch embedding's weights small enough (std 0.005 over 1,176 inputs) that
    the learned positions added to it count."""
    # deferred: transformers takes seconds to import, and tests import this module at collection
    import transformers
    tokenizer = build_byte_tokenizer(QWEN_VISION_TOKENS, QWEN_CHAT_TEMPLATE)
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in QWEN_VISION_TOKENS}
    config = transformers.Qwen3_5Config(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=16, linear_value_head_dim=16, num_hidden_layers=4,
                         layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                         rope_parameters={"rope_type": "default", "rope_theta": 10.0,
                                          "partial_rotary_factor": 0.25, "mrope_section": [4, 2, 2]},
                         max_position_embeddings=2048, rms_norm_eps=1e-6,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=0),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "A_log" in name or "dt_bias" in name:
                continue  # the decays keep transformers' initialisation (hybrid_checkpoints)
            # the text model's norms scale by 1 + w (drawn around 0), except the gated one's
            centred = "norm" in name and ("visual" in name or name.endswith("linear_attn.norm.weight"))
            param.normal_(1.0 if centred else 0.0, 0.005 if name.endswith("patch_embed.proj.weight") else 0.2)
    path = root / "qwen3_5_vl"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    transformers.Qwen2VLImageProcessorPil(**QWEN_PROCESSOR).save_pretrained(path)
    return path


def load_qwen3_5_vl_reference(path: Path):
    # deferred: transformers, for the reference model only
    import transformers
    return transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
        str(path), torch_dtype=torch.float32, attn_implementation="eager").eval()


GEMMA3_IMAGE_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
                       "eoi_token": "<end_of_image>"}
# Content parts: text as is, each image as Gemma's <start_of_image> (the processor expands it).
GEMMA3_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] }}{% else %}<start_of_image>{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
GEMMA3_IMAGE_SIZE = 56  # 4x4 patches of 14 pixels, pooled 2x2 into 4 tokens an image
GEMMA3_TOKENS_PER_IMAGE = 4


def make_gemma3_vl(root: Path, seed: int = 0, sliding_window: int = 4) -> Path:
    """Gemma 3 with a 1-layer SigLIP tower; the text model alternates sliding and full layers,
    its window no longer than an image's tokens so that it cuts into their bidirectional block."""
    # deferred: transformers takes seconds to import, and tests import this module at collection
    import transformers
    names = tuple(GEMMA3_IMAGE_TOKENS.values())
    tokenizer = build_byte_tokenizer(names, GEMMA3_CHAT_TEMPLATE, named_tokens=GEMMA3_IMAGE_TOKENS)
    ids = {key: tokenizer.convert_tokens_to_ids(tok) for key, tok in GEMMA3_IMAGE_TOKENS.items()}
    config = transformers.Gemma3Config(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         sliding_window=sliding_window, query_pre_attn_scalar=16,
                         layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.eos_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                           image_size=GEMMA3_IMAGE_SIZE, patch_size=14, vision_use_head=False),
        mm_tokens_per_image=GEMMA3_TOKENS_PER_IMAGE, image_token_index=ids["image_token"],
        boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    path = _save_random(transformers.Gemma3ForConditionalGeneration, config, seed, tokenizer, root / "gemma3_vl")
    processor = transformers.Gemma3ImageProcessorPil(size={"height": GEMMA3_IMAGE_SIZE, "width": GEMMA3_IMAGE_SIZE})
    processor.save_pretrained(path)
    transformers.Gemma3Processor(processor, tokenizer, image_seq_length=GEMMA3_TOKENS_PER_IMAGE).save_pretrained(path)
    return path


def load_gemma3_vl_reference(path: Path):
    # deferred: transformers, for the reference model and its processor only
    import transformers
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        str(path), torch_dtype=torch.float32, attn_implementation="eager").eval()
    return model, transformers.AutoProcessor.from_pretrained(str(path))


assert SPECIAL_TOKENS[1] == "<|end_of_text|>"  # the eos the configs above name
