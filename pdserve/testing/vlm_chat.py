"""Chat requests with images for the vision-language cluster tests: pictures, the parts the
openai client sends, a streamed greedy chat through a cluster, and the offline engine's answer to
the same conversation."""
from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image

from pdserve.protocol.sampling_params import SamplingParams

SIZES = [(112, 140), (196, 84), (84, 112)]  # (height, width): 20, 21 and 12 Qwen2.5-VL image tokens
# (text before, which pictures, text after): one image, then two of different sizes
CASES = [("Look: ", [0], " what is it?"), ("Two pictures ", [0, 1], " compared.")]


def random_pictures(seed: int = 1) -> list[Image.Image]:
    rng = np.random.RandomState(seed)
    return [Image.fromarray(rng.randint(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]


def data_url(picture) -> str:
    buf = io.BytesIO()
    picture.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def content(before: str, images, after: str) -> list[dict]:
    return [{"type": "text", "text": before}, *({"type": "image_url", "image_url": {"url": data_url(p)}}
                                                for p in images), {"type": "text", "text": after}]


def offline_output(llm, before: str, images, after: str, max_tokens: int, ignore_eos: bool = True):
    parts = [{"type": "text", "text": before}, *[{"type": "image"}] * len(images), {"type": "text", "text": after}]
    text = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                                   tokenize=False)
    return llm.generate({"prompt": text, "multi_modal_data": {"image": images}},
                        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos), use_tqdm=False)[0]


def offline(llm, before: str, images, after: str, max_tokens: int, ignore_eos: bool = True) -> tuple[list[int], int]:
    out = offline_output(llm, before, images, after, max_tokens, ignore_eos)
    return out.outputs[0].token_ids, len(out.prompt_token_ids)


def offline_prompt(llm, before: str, images, after: str) -> list[int]:
    """The prompt's token ids as the engine takes them: the image placeholders expanded."""
    return list(offline_output(llm, before, images, after, 1).prompt_token_ids)


def chat(url: str, before: str, images, after: str, max_tokens: int = 8, on_token=None):
    """(token ids, usage) of a streamed greedy chat completion."""
    import openai  # optional dependency: openai (the pdserve[test] extra)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model="vlm", messages=[{"role": "user", "content": content(before, images, after)}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True})
    ids, usage = [], None
    for chunk in stream:
        usage = chunk.usage or usage
        if chunk.choices:
            ids += chunk.choices[0].model_extra.get("token_ids") or []
            if on_token is not None:
                on_token(len(ids))
    return ids, usage


def transformers_greedy(reference, tokenizer, before: str, images, after: str, max_tokens: int) -> list[int]:
    """transformers' greedy tokens for the same conversation: reference is (model, processor)
    (vlm_checkpoints.load_*_reference), the prompt the chat template's, the pixels the processor's.
    It stops at EOS, where a stream asked to ignore it goes on: compare that many tokens."""
    import torch  # deferred: the cluster tests' own process needs torch only for the reference

    model, processor = reference
    parts = [{"type": "text", "text": before}, *[{"type": "image"}] * len(images), {"type": "text", "text": after}]
    text = tokenizer.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                         tokenize=False)
    batch = processor(text=[text], images=[list(images)], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_tokens, do_sample=False)
    return out[0, batch["input_ids"].shape[1]:].tolist()
