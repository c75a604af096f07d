"""The prompt text a chat request becomes: the tokenizer's chat template, or a plain fallback
for tokenizers without one. Used by the generation routes and by /tokenize."""
from __future__ import annotations

from typing import Any

from pdserve.router.errors import bad_request


def render_fallback_chat(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """Template for tokenizers without one: "<|role|>\\ncontent\\n" per message, then the
    assistant header the model continues from."""
    lines = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    return "".join(lines) + ("<|assistant|>\n" if add_generation_prompt else "")


def render_chat_prompt(tokenizer: Any, messages: list[dict[str, str]],
                       tools: list[dict] | None = None, add_generation_prompt: bool = True) -> tuple[str, bool]:
    """Returns the prompt text and whether the tokenizer should add special tokens to it
    (not when a real template rendered them already). Tools go to templates that list them."""
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, tools=tools or None,
                                                 add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # jinja raise_exception(): e.g. roles must alternate
            raise bad_request(f"chat template failed: {exc}", "messages") from exc
        return text, False
    return render_fallback_chat(messages, add_generation_prompt), True
