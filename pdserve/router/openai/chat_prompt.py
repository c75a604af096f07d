"""The prompt text a chat request becomes: the tokenizer's chat template, or the one given with
--chat-template. Without either a chat request is a 400, as in vLLM: a made-up template would
feed the model markers it was never trained on. Used by the generation routes and /tokenize."""
from __future__ import annotations

from typing import Any

from pdserve.router.openai.errors import bad_request

NO_TEMPLATE = ("this model's tokenizer has no chat template: start the router with --chat-template FILE, "
               "or send the rendered prompt to /v1/completions")


def render_chat_prompt(tokenizer: Any, messages: list[dict[str, Any]],
                       tools: list[dict] | None = None, add_generation_prompt: bool = True) -> tuple[str, bool]:
    """Returns the prompt text and whether the tokenizer should add special tokens to it
    (never: the template renders them). Tools go to templates that list them."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request(NO_TEMPLATE, "messages")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, tools=tools or None,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # jinja raise_exception(): e.g. roles must alternate
        raise bad_request(f"chat template failed: {exc}", "messages") from exc
    return text, False


_PROBE_MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
_PROBE_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOLS_IGNORED = "chat template drops tools"


def template_drops_tools(tokenizer: Any) -> bool:
    """Whether the chat template renders a prompt with tools exactly as without them: then the
    model never learns of the tools and tool_choice "auto" never calls one. (False when there
    is no template, or it fails on the probe: nothing to say about tools then.)"""
    if not getattr(tokenizer, "chat_template", None):
        return False
    try:
        with_tools = tokenizer.apply_chat_template(_PROBE_MESSAGES, tokenize=False, tools=[_PROBE_TOOL],
                                                   add_generation_prompt=True)
        without = tokenizer.apply_chat_template(_PROBE_MESSAGES, tokenize=False, add_generation_prompt=True)
    except Exception:
        return False
    return with_tools == without
