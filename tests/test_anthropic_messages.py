"""The Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through the official
`anthropic` SDK, against one real 1P1D cluster (`pdserve up` over NIXL, a random Llama served
with a chat template that lists tools).

The model is served by a Hub id from a local Hugging Face cache laid out in a temporary directory.
The reference is the chat-completions route on the same conversation: greedy, a message must have
the same text (and the same calls, under tool_choice "any" or a named tool) and the same token
counts as the chat completion, streamed or not, so no text is hard-coded. Errors must be 400s in
Anthropic's shape."""
from __future__ import annotations

import contextlib
import itertools
import json
import os

import anthropic
import httpx
import jsonschema
import openai
import pytest
import torch

from pdserve.testing.model_factory import make_model
from pdserve.testing.up_cluster import running_cluster

TEMPLATE = """{%- if tools %}<|system|>Tools:
{% for t in tools %}{{ t | tojson }}
{% endfor %}{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' and m.tool_calls -%}
<|assistant|>{{ m.content or '' }}{% for c in m.tool_calls %}<call>{{ c.function.name }} \
{{ c.function.arguments | tojson }}</call>{% endfor %}
{% elif m.role == 'tool' -%}
<|tool {{ m.tool_call_id }}|>{{ m.content }}
{% else -%}
<|{{ m.role }}|>{{ m.content }}
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|assistant|>{% endif -%}"""
SYSTEM = "You are a terse assistant who answers every question about the weather in one line."
TURNS = [{"role": "user", "content": "What is the weather like in Paris today?"},
         {"role": "assistant", "content": "Sunny."},
         {"role": "user", "content": "And in Rome?"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                            "properties": {"city": {"enum": ["Paris", "Rome"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}
CHAT_WEATHER = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                 "parameters": WEATHER["input_schema"]}}
GREEDY = {"temperature": 0}


HUB_ID, COMMIT = "acme/tiny-llama", "c" * 40
CONFIG_POSITIONS = 512  # the config's max_position_embeddings, which the cluster serves past


@contextlib.contextmanager
def _environ(**values: str):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A local Hugging Face cache (HF_HUB_CACHE, as huggingface_hub lays it out) holding the model
    under its Hub id, whose config allows 512 positions; yields the cache and the snapshot."""
    root = tmp_path_factory.mktemp("anthropic")
    repo = root / "hub" / f"models--{HUB_ID.replace('/', '--')}"
    (repo / "snapshots").mkdir(parents=True)
    make_model(root, "llama", seed=11, max_position_embeddings=CONFIG_POSITIONS).rename(repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return root / "hub", repo / "snapshots" / COMMIT


@pytest.fixture(scope="module")
def served(hub, tmp_path_factory):
    """The model is served by its Hub id, which the launcher, the router and the nodes each
    resolve in the cache, past its config's 512 positions: --max-model-len 1024 with
    --allow-long-max-model-len (the router's limit), and 40 blocks of 16 tokens a node (the nodes'
    640). test_a_prompt_over_the_context_... and test_past_the_configs_positions_... use the three."""
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TEMPLATE)
    flags = ("--model", HUB_ID, "--kv-transfer", "nixl", "--chat-template", str(template), "--num-kv-blocks", "40",
             "--max-model-len", "1024", "--allow-long-max-model-len")
    with _environ(HF_HUB_CACHE=str(hub[0]), HF_HUB_OFFLINE="1"), running_cluster(*flags) as (url, _):
        chat = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)
        assert chat.models.list().data[0].id == HUB_ID
        yield url, client, chat, HUB_ID


def _chat(chat, model, messages, max_tokens, **kwargs):
    return chat.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, **GREEDY, **kwargs)


def _text(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def _assert_usage(message, completion) -> None:
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == completion.usage.prompt_tokens
    assert usage.output_tokens == completion.usage.completion_tokens


def test_text_system_and_turns_equal_chat_completions(served):
    _, client, chat, model = served
    message = client.messages.create(model=model, max_tokens=20, system=SYSTEM, messages=TURNS, extra_body=GREEDY)
    completion = _chat(chat, model, [{"role": "system", "content": SYSTEM}, *TURNS], 20)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message._request_id == message.id
    assert _text(message) == completion.choices[0].message.content and _text(message)
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[completion.choices[0].finish_reason]
    _assert_usage(message, completion)
    # System as text blocks and turns as blocks: the same prompt.
    blocks = [{"role": t["role"], "content": [{"type": "text", "text": t["content"]}]} for t in TURNS]
    again = client.messages.create(model=model, max_tokens=20, system=[{"type": "text", "text": SYSTEM}],
                                   messages=blocks, extra_body=GREEDY)
    assert _text(again) == _text(message)
    # The prompt was served before: its full blocks come from the cache, and count as cache reads.
    assert again.usage.cache_read_input_tokens > 0
    counted = client.messages.count_tokens(model=model, system=SYSTEM, messages=TURNS)
    assert counted.input_tokens == completion.usage.prompt_tokens


def test_streamed_events_add_up_to_the_message(served):
    _, client, _, model = served
    whole = client.messages.create(model=model, max_tokens=16, system=SYSTEM, messages=TURNS, extra_body=GREEDY)
    events = list(client.messages.create(model=model, max_tokens=16, system=SYSTEM, messages=TURNS, stream=True,
                                         extra_body=GREEDY))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == _text(whole)
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    # The SDK's own accumulation of the stream.
    with client.messages.stream(model=model, max_tokens=16, system=SYSTEM, messages=TURNS,
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert _text(final) == _text(whole) and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_last_assistant_turn_is_a_prefill_the_answer_continues(served):
    """The reference: /v1/completions on the rendered conversation's tokens (vLLM's /tokenize) and
    then the prefill's."""
    url, client, chat, model = served
    prefill = "The weather in Rome is"
    conversation = [{"role": "system", "content": SYSTEM}, *TURNS]
    rendered = httpx.post(f"{url}/tokenize", json={"model": model, "messages": conversation}, timeout=30).json()
    continued = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": prefill, "add_special_tokens": False},
                           timeout=30).json()
    want = chat.completions.create(model=model, prompt=rendered["tokens"] + continued["tokens"], max_tokens=12,
                                   **GREEDY)
    message = client.messages.create(model=model, max_tokens=12, system=SYSTEM,
                                     messages=[*TURNS, {"role": "assistant", "content": prefill}], extra_body=GREEDY)
    assert _text(message) == want.choices[0].text
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == rendered["count"] + continued["count"]
    counted = client.messages.count_tokens(model=model, system=SYSTEM,
                                           messages=[*TURNS, {"role": "assistant", "content": prefill}])
    assert counted.input_tokens == rendered["count"] + continued["count"]


def test_stop_sequences_end_the_message_as_chat_stop_does(served):
    _, client, chat, model = served
    text = _chat(chat, model, TURNS, 24).choices[0].message.content
    at = next(k for k in range(2, len(text) - 2) if "\ufffd" not in text[k:k + 2] and text.find(text[k:k + 2]) == k)
    stop = text[at:at + 2]
    completion = _chat(chat, model, TURNS, 24, stop=[stop])
    message = client.messages.create(model=model, max_tokens=24, messages=TURNS, stop_sequences=["\x07never", stop],
                                     extra_body=GREEDY)
    assert _text(message) == completion.choices[0].message.content == text[:at]
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    streamed = list(client.messages.create(model=model, max_tokens=24, messages=TURNS, stop_sequences=[stop],
                                           stream=True, extra_body=GREEDY))
    assert (streamed[-2].delta.stop_reason, streamed[-2].delta.stop_sequence) == ("stop_sequence", stop)


def _tool_uses(message) -> list:
    return [block for block in message.content if block.type == "tool_use"]


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_tool_use_names_a_declared_tool_with_valid_input(served, choice):
    _, client, chat, model = served
    message = client.messages.create(model=model, max_tokens=120, messages=TURNS[:1], tools=[WEATHER],
                                     tool_choice=choice, extra_body=GREEDY)
    calls = _tool_uses(message)
    assert calls and message.stop_reason == "tool_use"
    for call in calls:
        assert call.name == "get_weather"
        jsonschema.validate(call.input, WEATHER["input_schema"])
    chat_choice = "required" if choice["type"] == "any" else {"type": "function", "function": {"name": "get_weather"}}
    completion = _chat(chat, model, TURNS[:1], 120, tools=[CHAT_WEATHER], tool_choice=chat_choice)
    assert [(c.name, c.input) for c in calls] == [(c.function.name, json.loads(c.function.arguments))
                                                   for c in completion.choices[0].message.tool_calls]
    # Streamed: the input's JSON arrives in input_json_delta pieces that parse to the same input.
    with client.messages.stream(model=model, max_tokens=120, messages=TURNS[:1], tools=[WEATHER],
                                tool_choice=choice, extra_body=GREEDY) as stream:
        pieces = [e.delta.partial_json for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert [(c.name, c.input) for c in _tool_uses(final)] == [(c.name, c.input) for c in calls]
    assert json.loads("".join(pieces)) == calls[0].input or len(calls) > 1


def test_tool_result_turn_equals_chat_tool_turn(served):
    _, client, chat, model = served
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Rome", "days": 2}}
    turns = [TURNS[0], {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, call]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Rain, 12 C"}]}]
    message = client.messages.create(model=model, max_tokens=16, messages=turns, tools=[WEATHER],
                                     tool_choice={"type": "none"}, extra_body=GREEDY)
    chat_turns = [TURNS[0], {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(call["input"])}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Rain, 12 C"}]
    completion = _chat(chat, model, chat_turns, 16, tools=[CHAT_WEATHER], tool_choice="none")
    assert _text(message) == completion.choices[0].message.content
    _assert_usage(message, completion)


def test_errors_are_anthropic_shaped_400s(served):
    url, client, _, model = served
    cases = [
        ({"model": model, "messages": TURNS}, "max_tokens"),  # required
        ({"model": model, "max_tokens": 8, "messages": [{"role": "robot", "content": "hi"}]}, "role"),
        ({"model": model, "max_tokens": 8, "messages": TURNS, "temperature": 1.5}, "temperature"),
        ({"model": model, "max_tokens": 8, "messages": TURNS, "tools": [WEATHER],
          "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
        ({"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
         "document"),
        ({"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGk="}}]}]}, "image"),
        ({"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "x " * 2000}]}, "context length"),
        ({"model": model, "max_tokens": 8, "messages": TURNS, "thinking": {"type": "enabled", "budget_tokens": 1024}},
         "thinking"),
    ]
    for body, words in cases:
        for stream in (False, True):
            response = httpx.post(f"{url}/v1/messages", json={**body, "stream": stream}, timeout=60)
            assert response.status_code == 400, (body, response.text)
            error = response.json()
            assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
            assert words in error["error"]["message"], error
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="no-such-model", max_tokens=8, messages=TURNS)
    assert caught.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model=model, messages=[{"role": "user", "content": [{"type": "video"}]}])


def test_a_prompt_over_the_context_is_a_400_on_every_route_streamed_or_not(served):
    """OpenAI's context_length_exceeded on chat, completions and Responses (Anthropic's
    invalid_request_error on messages), never a 5xx, streamed or not: over the model's context the
    router refuses it; over the nodes' (their KV cache), the router too, from the longest request
    each node's pongs say it takes, so that a stream is refused before its 200."""
    url, client, chat, model = served
    nodes = httpx.get(f"{url}/health", timeout=30).json()["nodes"]
    assert [n["max_model_len"] for n in nodes] == [640, 640], nodes
    for nodes_only, stream in itertools.product(("y " * 400, [{"role": "user", "content": "y " * 400}]),
                                                (False, True)):  # 800 tokens: 640 < 800 < 1024
        with pytest.raises(openai.BadRequestError) as caught:
            if isinstance(nodes_only, str):
                chat.completions.create(model=model, prompt=nodes_only, max_tokens=4, stream=stream)
            else:
                chat.chat.completions.create(model=model, messages=nodes_only, max_tokens=4, stream=stream)
        assert caught.value.code == "context_length_exceeded" and "640 tokens" in caught.value.message
        with pytest.raises(anthropic.BadRequestError) as caught:
            client.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": "y " * 400}],
                                   stream=stream)
        assert "maximum context length is 640" in caught.value.body["error"]["message"]
    long = "x " * 2000  # 4000 tokens of the byte tokenizer, past the model's 1024
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            chat.chat.completions.create(model=model, messages=[{"role": "user", "content": long}], max_tokens=4,
                                         stream=stream)
        assert caught.value.code == "context_length_exceeded" and "1024" in caught.value.message
        with pytest.raises(openai.BadRequestError) as caught:
            chat.completions.create(model=model, prompt=long, max_tokens=4, stream=stream)
        assert caught.value.code == "context_length_exceeded"
        with pytest.raises(anthropic.BadRequestError) as caught:
            client.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": long}],
                                   stream=stream)
        assert "maximum context length is 1024" in caught.value.body["error"]["message"]
        with pytest.raises(openai.BadRequestError) as caught:  # the Responses API, on the chat path too
            chat.responses.create(model=model, input=long, max_output_tokens=4, stream=stream)
        assert caught.value.code == "context_length_exceeded" and "1024" in caught.value.message
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:  # over the nodes' 640 only
            chat.responses.create(model=model, input="y " * 400, max_output_tokens=4, stream=stream)
        assert caught.value.code == "context_length_exceeded" and "640 tokens" in caught.value.message


def test_past_the_configs_positions_with_the_override_equals_transformers(served, hub):
    """--allow-long-max-model-len: a prompt of 600 tokens, past the config's 512 positions, runs
    through P/D (the router accepts it, the prefill node computes it, NIXL hands it over, the
    decode node continues it) with transformers' greedy tokens on the same weights, streamed or
    not; /v1/messages takes one as long."""
    _, client, chat, model = served
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: this test's reference only
    tokenizer = AutoTokenizer.from_pretrained(hub[1])
    ids = tokenizer(" ".join(f"{SYSTEM} ({i})" for i in range(20)), add_special_tokens=False)["input_ids"][:600]
    assert len(ids) == 600 > CONFIG_POSITIONS
    reference = AutoModelForCausalLM.from_pretrained(hub[1], torch_dtype="float32")
    out = reference.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):]
    want = tokenizer.decode(out, skip_special_tokens=True)
    completion = chat.completions.create(model=model, prompt=ids, max_tokens=8, **GREEDY)
    assert completion.choices[0].text == want and completion.usage.prompt_tokens == 600
    streamed = chat.completions.create(model=model, prompt=ids, max_tokens=8, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want
    text = tokenizer.decode(ids[:560])
    message = client.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": text}],
                                     extra_body=GREEDY)
    completion = _chat(chat, model, [{"role": "user", "content": text}], 4)
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens > CONFIG_POSITIONS
    assert _text(message) == completion.choices[0].message.content
