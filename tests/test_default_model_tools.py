"""The default model (SmolLM2-135M-Instruct, `pdserve up` with no flags) calls tools and embeds.

Its own chat template drops `tools`; pdserve serves it with a tool-capable one
(pdserve/router/openai/chat_templates.py) that renders every conversation without tools exactly as the
GGUF's template does. Checked here: that equality, that the router can tell a template that drops
tools, LangChain's bind_tools loop with tool_choice at its default (the model calls the tool, gets
the result, answers in text), a string argument taken from the question rather than copied from
the template's example, and /v1/embeddings ranking a paraphrase above an unrelated sentence.
"""
from __future__ import annotations

import numpy as np
import openai
import pytest
from transformers import AutoTokenizer

from pdserve.models.gguf import DEFAULT_MODEL
from pdserve.models.loader import resolve_model_path
from pdserve.router.openai.chat_prompt import template_drops_tools
from pdserve.router.openai.chat_templates import builtin_chat_template

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(resolve_model_path(DEFAULT_MODEL)))


def test_template_keeps_smollm2_format_and_lists_tools(tokenizer):
    own = tokenizer.chat_template
    assert template_drops_tools(tokenizer)  # the GGUF's template: the router warns and says so
    ours = builtin_chat_template(DEFAULT_MODEL)
    for messages in CONVERSATIONS:
        for generation_prompt in (True, False):
            tokenizer.chat_template = own
            want = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
            tokenizer.chat_template = ours
            assert tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=generation_prompt) == want
    assert not template_drops_tools(tokenizer)


@pytest.fixture(scope="module")
def served(default_model_cluster):
    """`pdserve up` with no flags, the default model: conftest's cluster, shared with other modules."""
    url = default_model_cluster
    return url, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)


@pytest.mark.parametrize(("prompt", "city"), [("What is the weather in Paris?", "Paris"),
                                            ("What's the weather like in Tokyo today?", "Tokyo")])
def test_langchain_bind_tools_loop_calls_and_finishes(served, prompt, city):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    url, _ = served

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a given city."""
        return f"sunny, 21 C in {city}"

    llm = ChatOpenAI(model=DEFAULT_MODEL, base_url=f"{url}/v1", api_key="none", temperature=0, max_tokens=48,
                     max_retries=0).bind_tools([get_weather])  # tool_choice left at its default
    messages = [HumanMessage(prompt)]
    calls = []
    for _ in range(3):
        reply = llm.invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            calls.append(call)
            messages.append(ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"]))
    assert [c["name"] for c in calls] == ["get_weather"] and calls[0]["args"]["city"] == city
    assert not messages[-1].tool_calls and messages[-1].content, messages[-1]


STOCK = {"type": "function", "function": {"name": "get_stock_price", "description": "Get the latest price of a stock.",
                                          "parameters": {"type": "object", "properties": {"ticker": {"type": "string"}},
                                                         "required": ["ticker"]}}}


def test_example_call_shows_no_parameter_name_as_a_value(tokenizer):
    """The template's example call fills a string parameter with "...", not the parameter's
    name, which the 135M model copied as the value ({"ticker": "ticker"}, issue 63)."""
    tokenizer.chat_template = builtin_chat_template(DEFAULT_MODEL)
    tools = [STOCK, {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}, "on": {"type": "boolean"}, "unit": {"enum": ["c", "f"]}}}}}]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tools=tools, tokenize=False,
                                         add_generation_prompt=True)
    assert '{"name": "get_stock_price", "arguments": {"ticker": "..."}}' in text
    tools.reverse()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tools=tools, tokenize=False,
                                         add_generation_prompt=True)
    assert '{"name": "f", "arguments": {"n": 1, "on": true, "unit": "c"}}' in text


@pytest.mark.parametrize(("prompt", "ticker"), [("What's the stock price of AAPL?", "AAPL"),
                                              ("Price of MSFT shares?", "MSFT")])
def test_a_string_argument_comes_from_the_question(served, prompt, ticker):
    _, client = served
    choice = client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": prompt}],
                                            tools=[STOCK], temperature=0, max_tokens=48).choices[0]
    calls = choice.message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_stock_price", f'{{"ticker": "{ticker}"}}')]


def test_embeddings_rank_a_paraphrase_first(served):
    _, client = served
    texts = ["The cat is sleeping on the sofa.", "A cat naps on the couch.",
             "Interest rates rose sharply in the third quarter."]
    vectors = [np.asarray(d.embedding) for d in client.embeddings.create(model=DEFAULT_MODEL, input=texts).data]
    assert all(abs(np.linalg.norm(v) - 1) < 1e-5 for v in vectors)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2]
