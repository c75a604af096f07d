"""What one HTTP generation request becomes: a prompt and SamplingParams per choice, the flavor
that shapes the response, and the usage's prompt token count.

  * /v1/completions: a prompt, or a batch of them (texts or token-id lists); choice i*n+j is
    prompt i's choice j, as OpenAI indexes them. echo (with max_tokens 0: the prompt only) and
    echo with logprobs, whose prompt logprobs the engine computes where the prompt is computed.
  * /v1/chat/completions: the chat template (400 without one), tools as tool_choice asks; image
    parts are checked (media.py) and, for a vision-language model, their placeholders expanded
    (the job's images); a text model refuses them.

`router` is the app's _Router (duck-typed here: it tokenizes, checks lengths, builds params).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pdserve.protocol.sampling_params import SamplingParams
from pdserve.router.openai.chat_prompt import render_chat_prompt
from pdserve.router.openai.errors import bad_request
from pdserve.router.openai.responses import ChatFlavor, CompletionFlavor, Flavor
from pdserve.router.openai.schemas import ChatCompletionRequest, CompletionRequest
from pdserve.router.openai.structured_request import ToolPlan, ToolsError, checked_spec
from pdserve.router.openai.tool_calls import ParsedToolCallChatFlavor, ToolCallChatFlavor
from pdserve.router.openai.tool_tags import tool_call_spec


@dataclass
class GenerationJob:
    choice_prompts: list[list[int]]  # each choice's prompt token ids
    params: list[SamplingParams]     # each choice's sampling params
    flavor: Flavor
    prompt_tokens: int               # every prompt once, for usage (image tokens included)
    images: tuple = ()               # a vision-language prompt's ImageInputs (pdserve.protocol.multimodal)

    @property
    def max_prompt_tokens(self) -> int:
        return max(len(p) for p in self.choice_prompts)


async def completion_job(router: Any, body: CompletionRequest) -> GenerationJob:
    try:
        prompts = body.prompts()
    except ValueError as exc:
        raise bad_request(str(exc), "prompt") from exc
    ids_list: list[list[int]] = []
    for prompt in prompts:
        ids = await router.encode(prompt, True) if isinstance(prompt, str) else list(prompt)
        router.check_token_ids(ids, "prompt")
        ids_list.append(ids)
    n = body.num_choices
    choice_prompts, params = [], []
    for ids in ids_list:
        # max_tokens 0 (echo only): the engine still draws one token, which is not shown.
        max_tokens = router.resolve_max_tokens(body.max_tokens, len(ids), "max_tokens") or 1
        choice_prompts += [ids] * n
        params += [_with_echo_logprobs(p, body) for p in router.build_params(body, max_tokens, body.logprobs)]
    echo = [p if isinstance(p, str) else router.tokenizer.decode(p) for p in prompts] if body.echo else None
    flavor = CompletionFlavor(router.texts, body.logprobs is not None, body.return_token_ids, echo, ids_list, n,
                              body.echo_only, body.logprobs, body.prompt_logprobs is not None)
    await _check_satisfiable(router, params)
    return GenerationJob(choice_prompts, params, flavor, sum(len(ids) for ids in ids_list))


async def _check_satisfiable(router: Any, params: list[SamplingParams], param: str | None = None) -> None:
    """param: the field the constraint comes from ("tools" for tool_choice's grammar)."""
    spec = params[0].structured if params else None
    if spec is not None:
        try:
            await router.grammars.check(spec)
        except ValueError as exc:
            raise bad_request(str(exc), param) from exc


def _with_echo_logprobs(params: SamplingParams, body: CompletionRequest) -> SamplingParams:
    """echo with logprobs: the echoed prompt's tokens get logprobs (and top-N) too."""
    if not body.echo or body.logprobs is None:
        return params
    wanted = max(body.logprobs, params.prompt_logprobs or 0)
    return dataclasses.replace(params, prompt_logprobs=wanted)


def _tools_plan(body: ChatCompletionRequest) -> ToolPlan | None:
    try:
        return body.tools_plan()
    except ValueError as exc:
        raise bad_request(str(exc), "tools" if isinstance(exc, ToolsError) else "tool_choice") from exc


def _with_tool_call_tag(router: Any, plan: ToolPlan | None, params: list[SamplingParams]) -> list[SamplingParams]:
    """tool_choice "auto": a call the model opens is held to the declared tools (tool_tags),
    unless the request already asks for a structured output (response_format and the like)."""
    if plan is None or plan.mode != "auto" or not params or params[0].structured is not None:
        return params
    try:
        spec = tool_call_spec(plan, router.tool_parser.name, router.special_tokens, checked_spec)
    except ValueError as exc:
        raise bad_request(f"the tools' parameters cannot constrain a call: {exc}", "tools") from exc
    return params if spec is None else [dataclasses.replace(p, structured=spec) for p in params]


async def chat_prompt(router: Any, body: ChatCompletionRequest,
                      continuation: str = "") -> tuple[ToolPlan | None, list[int], tuple]:
    """The request's tool plan, its prompt's token ids (the template rendered with the tools it
    shows, then `continuation`: the start of the answer, which the model continues) and its
    images (a vision-language model's ImageInputs)."""
    plan = _tools_plan(body)
    tools = plan.tools if plan is not None else None
    checked = await router.media.check(body.image_refs(), body.model or router.model_name)  # or a 400
    text, add_special = render_chat_prompt(router.tokenizer, body.plain_messages(bool(checked)), tools)
    ids, images = await router.media.expand(await router.encode(text + continuation, add_special), checked)
    router.check_token_ids(ids, "messages")
    return plan, ids, images


async def chat_job(router: Any, body: ChatCompletionRequest, continuation: str = "") -> GenerationJob:
    """continuation: the start of the answer, put after the rendered prompt (chat_prompt)."""
    plan, ids, images = await chat_prompt(router, body, continuation)
    max_tokens = router.resolve_max_tokens(body.requested_max_tokens(), len(ids), "max_tokens")
    logprobs = body.engine_logprobs()
    built = router.build_params(body, max_tokens, logprobs)
    params = _with_tool_call_tag(router, plan, built)
    from_tools = plan is not None and (plan.mode in ("named", "required") or params is not built)
    await _check_satisfiable(router, params, "tools" if from_tools else None)
    want = logprobs is not None
    if plan is None:
        flavor: Flavor = ChatFlavor(router.texts, want, body.return_token_ids)
    elif plan.mode == "named":
        flavor = ToolCallChatFlavor(router.texts, want, body.return_token_ids, plan.name)
    else:
        parser = router.tool_parser if plan.mode == "auto" else None
        flavor = ParsedToolCallChatFlavor(router.texts, want, body.return_token_ids, parser)
        flavor.max_calls = None if plan.parallel else 1
        if parser is not None and parser.marker in router.special_tokens:
            # The call's marker is a special token: keep it in the text, or nothing marks the call.
            params = [dataclasses.replace(p, skip_special_tokens=False) for p in params]
    flavor.want_prompt_logprobs = body.prompt_logprobs is not None
    return GenerationJob([ids] * len(params), params, flavor, len(ids), images)
