"""Agent frameworks on `pdserve up` with no flags (the default model, SmolLM2-135M-Instruct).

The OpenAI Agents SDK (`openai-agents`, the `test` extra) runs an Agent with one function tool
and tool_choice left at its default, through OpenAIResponsesModel and OpenAIChatCompletionsModel,
with Runner.run and Runner.run_streamed: the model calls the tool with the city of the question,
the tool's result goes back, and the run ends on a text answer. The SDK sends its tools with
`strict: true` and fails a run whose call names an undeclared tool (ModelBehaviorError), so a
completed run also checks that the server held the call to the declared tool
(pdserve/router/openai/tool_tags.py). A tool whose argument is a nested pydantic model (its schema
holds $defs and $refs) is called with valid arguments under tool_choice "required", named and
"auto", through both model classes.

The Vercel AI SDK's generateText with a tool, over the chat and the Responses API, runs the
script tests/js/weather.mjs under node; it skips where node or tests/js/node_modules (installed
by scripts/setup.sh) is missing.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from pdserve.models.gguf import DEFAULT_MODEL
from pdserve.testing.nested_tools import Address, Resident

PROMPT = "What is the weather in Paris?"
JS_DIR = Path(__file__).parent / "js"


@pytest.fixture(scope="module")
def url(default_model_cluster):
    """`pdserve up` with no flags, the default model: conftest's cluster, shared with other modules."""
    return default_model_cluster


def _agent(url: str, model_class: str, name: str, tools: list, tool_choice: str | None = None, **kwargs):
    """(an Agent on the default model through model_class's API, its client: close it after the run)."""
    # The SDK is imported here: importing it pulls in mcp and its web stack, wanted by this module only.
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, set_tracing_disabled

    set_tracing_disabled(True)  # tracing would upload spans to OpenAI's platform
    # One client per run: an AsyncOpenAI client is bound to the event loop it first ran on.
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    model_type = OpenAIResponsesModel if model_class == "responses" else OpenAIChatCompletionsModel
    agent = Agent(name=name, instructions="You are a helpful assistant.", tools=tools,
                  model=model_type(model=DEFAULT_MODEL, openai_client=client),
                  model_settings=ModelSettings(temperature=0, max_tokens=64, tool_choice=tool_choice), **kwargs)
    return agent, client


async def _run_agent(url: str, model_class: str, streamed: bool) -> tuple[list[str], object, list[str]]:
    from agents import Runner, function_tool  # (the SDK: see _agent)

    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a given city."""
        calls.append(city)
        return f"sunny, 21 C in {city}"

    agent, client = _agent(url, model_class, "weather", [get_weather])  # tool_choice: the default
    events: list[str] = []
    if streamed:
        result = Runner.run_streamed(agent, PROMPT, max_turns=4)
        async for event in result.stream_events():
            if event.type == "run_item_stream_event":
                events.append(event.name)
    else:
        result = await Runner.run(agent, PROMPT, max_turns=4)
    await client.close()
    return calls, result, events


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
@pytest.mark.parametrize("model_class", ["responses", "chat_completions"])
def test_agents_sdk_calls_the_tool_and_answers(url, model_class, streamed):
    calls, result, events = asyncio.run(_run_agent(url, model_class, streamed))
    assert calls == ["Paris"], calls  # called once, with the question's city
    items = [item.type for item in result.new_items]
    assert items[:2] == ["tool_call_item", "tool_call_output_item"] and items[-1] == "message_output_item", items
    assert isinstance(result.final_output, str) and result.final_output.strip(), result.final_output
    if streamed:
        assert "tool_called" in events and "tool_output" in events, events


async def _register(url: str, model_class: str, tool_choice: str | None) -> tuple[dict, list[Resident], object]:
    from agents import Runner, function_tool  # (the SDK: see _agent)

    calls: list[Resident] = []

    @function_tool
    def register(resident: Resident) -> str:
        """Register a resident at their home address."""
        calls.append(resident)
        return f"registered {resident.name}"

    # stop_on_first_tool: the run ends with the tool's result. What the 135M model says after a
    # result is not under test here (it calls the tool again, having nothing else to say).
    agent, client = _agent(url, model_class, "registrar", [register], tool_choice,
                           tool_use_behavior="stop_on_first_tool")
    result = await Runner.run(agent, "Register ada, who lives in Rome on floor 2.", max_turns=2)
    await client.close()
    return register.params_json_schema, calls, result


@pytest.mark.parametrize("model_class", ["responses", "chat_completions"])
def test_agents_sdk_nested_pydantic_tool_under_each_tool_choice(url, model_class):
    """The SDK sends the nested model as $defs/$ref with strict: true. A schema the server could
    not build a grammar from was a 400 under "required" (issue 63); a call the SDK cannot
    validate into a Resident fails the run (ModelBehaviorError)."""
    for tool_choice in ("required", "register", None):
        schema, calls, result = asyncio.run(_register(url, model_class, tool_choice))
        assert "$defs" in schema and "$ref" in json.dumps(schema["properties"]), schema
        assert calls == [Resident(name="ada", home=Address(city="Rome", floor=2))], (tool_choice, calls)
        assert result.final_output == "registered ada", (tool_choice, result.final_output)


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_vercel_ai_sdk_generate_text_calls_the_tool(url, api):
    node = shutil.which("node")
    if node is None or not (JS_DIR / "node_modules" / "ai").is_dir():
        pytest.skip("needs node and tests/js/node_modules (scripts/setup.sh runs npm install there)")
    out = subprocess.run([node, str(JS_DIR / "weather.mjs"), f"{url}/v1", api, PROMPT], cwd=JS_DIR,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["toolCalls"] == [{"name": "get_weather", "input": {"city": "Paris"}}], got
    assert got["calls"] == ["Paris"] and got["finish"] == ["tool-calls", "stop"] and got["text"].strip(), got
