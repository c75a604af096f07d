"""The Responses API (`/v1/responses`) against the default `pdserve up` (1 prefill + 1 decode node
over NIXL, SmolLM2-135M-Instruct, no flags), through the official openai client, LangChain's
`use_responses_api=True`, pydantic-ai's `OpenAIResponsesModel` and `litellm.responses`.

The reference is the chat-completions route on the same messages: greedy, a response must have
the same text, tool call and token counts as the chat completion of the conversation it stands
for, so no text is hard-coded. A follow-up with previous_response_id must be served from the
prefix cache (cached_tokens > 0)."""
from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pytest
from openai.types.responses import Response
from pydantic import BaseModel

QUESTION = "What is the capital of France? Answer in one sentence."
INSTRUCTIONS = "You are a terse geography assistant."
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "additionalProperties": False,
                          "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                          "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
GREEDY = {"temperature": 0}


START_TIMEOUT_S = 420  # the shared cluster's start, when this module is the first to ask for it


@pytest.fixture(scope="module")
def served(default_model_cluster):
    """`pdserve up` with no flags, the default model: conftest's cluster, shared with other modules."""
    url = default_model_cluster
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    return url, client, client.models.list().data[0].id


def _chat(client, model, messages, max_tokens, **kwargs):
    return client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, **GREEDY, **kwargs)


def _assert_same_as_chat(response, chat) -> None:
    """Same text and token counts; and the same calls, should a tool-capable template make the
    model call one under tool_choice "auto"."""
    message = chat.choices[0].message
    assert response.output_text == (message.content or "")
    calls = [(o.name, o.arguments) for o in response.output if o.type == "function_call"]
    assert calls == [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens


def test_text_and_message_input_equal_chat_completions(served):
    _, client, model = served
    chat = _chat(client, model, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}], 24)
    plain = client.responses.create(model=model, input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=24,
                                    **GREEDY)
    _assert_same_as_chat(plain, chat)
    assert plain.status == "completed" and plain.id.startswith("resp_") and plain.instructions == INSTRUCTIONS
    items = [{"role": "developer", "content": INSTRUCTIONS},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    as_items = client.responses.create(model=model, input=items, max_output_tokens=24, **GREEDY)
    _assert_same_as_chat(as_items, chat)
    # Cut short: incomplete, as chat's finish_reason "length".
    short = client.responses.create(model=model, input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=3,
                                    **GREEDY)
    assert _chat(client, model, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}],
                 3).choices[0].finish_reason == "length"
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.usage.output_tokens == 3


def test_streamed_events_add_up_to_the_response(served):
    _, client, model = served
    whole = client.responses.create(model=model, input=QUESTION, max_output_tokens=20, **GREEDY)
    events = list(client.responses.create(model=model, input=QUESTION, max_output_tokens=20, stream=True, **GREEDY))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == whole.usage.output_tokens
    assert events[2].item.id == events[-2].item.id == final.output[0].id
    # A streamed response is stored too, by the time its last event is read.
    follow = client.responses.create(model=model, input="Thanks!", previous_response_id=final.id,
                                     max_output_tokens=2, **GREEDY)
    assert follow.usage.input_tokens_details.cached_tokens > 0


def test_previous_response_id_continues_from_the_prefix_cache(served):
    url, client, model = served
    first = client.responses.create(model=model, input=QUESTION, max_output_tokens=16, **GREEDY)
    follow = client.responses.create(model=model, input="And the capital of Italy?", previous_response_id=first.id,
                                     max_output_tokens=16, **GREEDY)
    history = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And the capital of Italy?"}]
    _assert_same_as_chat(follow, _chat(client, model, history, 16))
    assert follow.previous_response_id == first.id
    # The follow-up's prompt starts with the first one's tokens: a node holds them.
    assert follow.usage.input_tokens_details.cached_tokens > 0
    assert client.responses.retrieve(first.id).output_text == first.output_text
    # The stored body is a Response as the SDK declares it, checked strictly (the client parses leniently).
    stored = Response.model_validate(httpx.get(f"{url}/v1/responses/{first.id}", timeout=10).json())
    assert stored.output_text == first.output_text and stored.usage == first.usage
    # store=False: neither retrievable nor continuable, each said in OpenAI's error shape.
    unstored = client.responses.create(model=model, input=QUESTION, max_output_tokens=2, store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model, input="hi", previous_response_id=unstored.id, max_output_tokens=2)
    assert caught.value.body["code"] == "previous_response_not_found"
    assert caught.value.body["param"] == "previous_response_id"
    client.responses.delete(first.id)
    assert httpx.get(f"{url}/v1/responses/{first.id}", timeout=10).status_code == 404


def test_function_tool_call_and_its_result(served):
    _, client, model = served
    ask = [{"role": "user", "content": "What is the weather in Rome?"}]
    named = {"type": "function", "name": "get_weather"}
    call_resp = client.responses.create(model=model, input=ask, tools=[WEATHER], tool_choice=named,
                                        max_output_tokens=40, **GREEDY)
    call = call_resp.output[0]
    chat = _chat(client, model, ask, 40, tools=[CHAT_WEATHER],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert call.arguments == chat.choices[0].message.tool_calls[0].function.arguments
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    # Streamed: the call's item, its argument deltas, then the whole arguments.
    events = list(client.responses.create(model=model, input=ask, tools=[WEATHER], tool_choice=named,
                                          max_output_tokens=40, stream=True, **GREEDY))
    added = next(e for e in events if e.type == "response.output_item.added")
    assert (added.item.type, added.item.name) == ("function_call", "get_weather")
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert deltas == done.arguments == call.arguments
    # "required": the grammar holds the output to a call of one of the tools.
    required = client.responses.create(model=model, input=ask, tools=[WEATHER], tool_choice="required",
                                       max_output_tokens=60, **GREEDY)
    assert [o.type for o in required.output] == ["function_call"] and required.output[0].name == "get_weather"
    # The result goes back, after previous_response_id or with the whole history as items.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 25 C"}
    after = client.responses.create(model=model, input=[result], previous_response_id=call_resp.id, tools=[WEATHER],
                                    max_output_tokens=16, **GREEDY)
    items = [*ask, {"type": "function_call", "call_id": call.call_id, "name": call.name,
                    "arguments": call.arguments}, result]
    stateless = client.responses.create(model=model, input=items, tools=[WEATHER], max_output_tokens=16, **GREEDY)
    history = [*ask, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 25 C"}]
    reference = _chat(client, model, history, 16, tools=[CHAT_WEATHER])
    _assert_same_as_chat(after, reference)
    _assert_same_as_chat(stateless, reference)


def test_text_format_json_schema(served):
    _, client, model = served
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]},
                                               "is_capital": {"type": "boolean"}},
              "required": ["city", "is_capital"], "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "city", "schema": schema, "strict": True}
    resp = client.responses.create(model=model, input=QUESTION, text={"format": fmt}, max_output_tokens=40, **GREEDY)
    chat = _chat(client, model, [{"role": "user", "content": QUESTION}], 40, response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}})
    _assert_same_as_chat(resp, chat)
    assert json.loads(resp.output_text)["city"] in ("Paris", "Lyon")


BAD = [
    ({"input": "hi", "frequency_penalty": 1}, "frequency_penalty"),  # not a Responses field
    ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input"),  # no call_id
    ({"input": []}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "hi", "temperature": 3}, "temperature"),
]


@pytest.mark.parametrize("body,param", BAD)
def test_bad_input_is_a_400_naming_the_field(served, body, param):
    url, _, _ = served
    resp = httpx.post(f"{url}/v1/responses", json={**body, "max_output_tokens": body.get("max_output_tokens", 2)},
                      timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["param"] == param, error


def test_langchain_use_responses_api(served):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    url, _, model = served
    kwargs = dict(model=model, base_url=f"{url}/v1", api_key="none", temperature=0, max_tokens=16, max_retries=0)
    responses, chat = ChatOpenAI(use_responses_api=True, **kwargs), ChatOpenAI(**kwargs)
    got = responses.invoke(QUESTION)
    want = chat.invoke(QUESTION)
    assert got.text == want.text and got.usage_metadata["input_tokens"] == want.usage_metadata["input_tokens"]
    assert "".join(chunk.text for chunk in responses.stream(QUESTION)) == want.text

    @tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        return "sunny"

    history = [HumanMessage("What is the weather in Rome?")]
    caller = ChatOpenAI(use_responses_api=True, **{**kwargs, "max_tokens": 60})  # room for the whole call
    message = caller.bind_tools([get_weather], tool_choice="any").invoke(history)
    assert [c["name"] for c in message.tool_calls] == ["get_weather"]
    assert message.tool_calls[0]["args"]["city"] in ("Paris", "Rome")
    history += [message, ToolMessage("sunny", tool_call_id=message.tool_calls[0]["id"])]
    # The same history (call and result) through both routes: the same prompt, the same answer.
    got = responses.bind_tools([get_weather]).invoke(history)
    want = chat.bind_tools([get_weather]).invoke(history)
    assert got.text == want.text and got.usage_metadata["input_tokens"] == want.usage_metadata["input_tokens"]


class City(BaseModel):
    name: Literal["Paris", "Rome"]
    country: str


def test_pydantic_ai_responses_model(served):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider
    url, client, model = served
    responses_model = OpenAIResponsesModel(model, provider=OpenAIProvider(base_url=f"{url}/v1", api_key="none"))
    settings = {"temperature": 0, "max_tokens": 16}
    result = Agent(responses_model, model_settings=settings).run_sync(QUESTION)
    want = _chat(client, model, [{"role": "user", "content": QUESTION}], 16)
    assert result.output == want.choices[0].message.content
    assert result.usage.input_tokens == want.usage.prompt_tokens
    # Structured output (pydantic-ai's output tool): a City, whatever the small model puts in it.
    city = Agent(responses_model, output_type=City, model_settings={**settings, "max_tokens": 60}).run_sync(
        "Which city is the capital of Italy?").output
    assert isinstance(city, City)


def test_litellm_responses(served):
    import os
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list
    import litellm
    url, client, model = served
    kwargs = dict(model=f"openai/{model}", api_base=f"{url}/v1", api_key="none", temperature=0, max_output_tokens=16)
    first = litellm.responses(input=QUESTION, **kwargs)
    want = _chat(client, model, [{"role": "user", "content": QUESTION}], 16)
    assert first.output[0].content[0].text == want.choices[0].message.content
    follow = litellm.responses(input="And of Italy?", previous_response_id=first.id, **kwargs)
    assert follow.usage.input_tokens_details.cached_tokens > 0
