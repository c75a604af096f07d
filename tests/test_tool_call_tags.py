"""Tool calls valid by construction under tool_choice "auto" (pdserve/router/openai/tool_tags.py).

Without a cluster: the structural tag, compiled against the default model's vocabulary, leaves
free text alone, holds an opened call to a declared name and its schema (nested and recursive
pydantic models too), allows several calls in the family's format with parallel_tool_calls (up to
MAX_PARALLEL_CALLS, one without it), and only the stop token after the calls. On `pdserve up`
with no flags (SmolLM2-135M, the official openai client): across 50 prompts and tool sets every
returned call names a declared tool and its arguments validate against the tool's schema
(jsonschema), the calls end the turn; and a chat
with tools whose answer opens no call is token for token the unconstrained completion of the
same prompt.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from pdserve.models.gguf import DEFAULT_MODEL
from pdserve.models.model_path import load_tokenizer, resolve_model_path
from pdserve.router.openai.chat_prompt import render_chat_prompt
from pdserve.router.openai.chat_templates import builtin_chat_template
from pdserve.router.openai.structured_request import checked_spec, tool_plan
from pdserve.router.openai.tool_parsers import HermesParser, Llama3JsonParser, MistralParser
from pdserve.router.openai.tool_tags import MAX_PARALLEL_CALLS, tool_call_spec
from pdserve.testing.nested_tools import Resident


def _tool(name: str, description: str, properties: dict) -> dict:
    # OpenAI's strict form (what the Agents SDK sends): every property required, no others.
    return {"type": "function", "function": {"name": name, "description": description, "strict": True, "parameters": {
        "type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}}}


WEATHER = _tool("get_weather", "Get the current weather in a city.",
                {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}})
TIME = _tool("get_time", "Get the time in a time zone.", {"zone": {"enum": ["UTC", "CET", "PST", "JST"]}})
CALC = _tool("calculate", "Apply an arithmetic operation to two numbers.",
             {"a": {"type": "number"}, "b": {"type": "number"}, "op": {"enum": ["add", "sub", "mul", "div"]}})
SEARCH = _tool("search_web", "Search the web.",
               {"query": {"type": "string", "maxLength": 80}, "max_results": {"type": "integer", "minimum": 1, "maximum": 10}})
EMAIL = _tool("send_email", "Send an email.", {"to": {"type": "string"}, "subject": {"type": "string", "maxLength": 60}})
ALARM = _tool("set_alarm", "Set an alarm.", {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                             "minute": {"type": "integer", "minimum": 0, "maximum": 59}})
FLIGHT = _tool("book_flight", "Book a flight.", {"origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                                 "destination": {"type": "string", "pattern": "^[A-Z]{3}$"}})
MONEY = _tool("convert_currency", "Convert money between currencies.",
              {"amount": {"type": "number", "minimum": 0}, "to": {"enum": ["USD", "EUR", "JPY"]}})
TOOL_SETS = [[WEATHER], [TIME, WEATHER], [CALC], [SEARCH, EMAIL], [ALARM, TIME], [FLIGHT], [MONEY, CALC],
             [EMAIL], [WEATHER, SEARCH, ALARM], [FLIGHT, MONEY]]
PROMPTS = [
    "What is the weather in Paris?", "How hot is it in Cairo right now, in fahrenheit?", "What time is it in Tokyo?",
    "Add 17 and 25.", "What is 9 times 12?", "Find recent news about electric cars.",
    "Email bob@example.com that the meeting moved to Friday.", "Wake me up at 6:30 tomorrow.",
    "Book me a flight from Boston to Denver.", "Convert 120 dollars to euros.", "Is it raining in London?",
    "Search for the best pizza recipe.", "Set an alarm for 7 in the morning.", "Divide 144 by 12.",
    "Tell me the weather in Tokyo and the time there.", "I need to fly from JFK to LAX next week.",
    "Paris", "Send a thank-you note to alice@example.com.", "How many yen is 50 euros?",
    "Look up the population of Brazil.", "Remind me at 22:15.", "What's the temperature in Oslo?",
    "Please multiply 3.5 by 4.", "Who won the 2018 World Cup?", "Check the forecast for Madrid, in celsius.",
]
CASES = [(p, TOOL_SETS[(i + k) % len(TOOL_SETS)]) for k in (0, 5) for i, p in enumerate(PROMPTS)]  # 50


@pytest.fixture(scope="module")
def tokenizer():
    tok = load_tokenizer(resolve_model_path(DEFAULT_MODEL))
    tok.chat_template = builtin_chat_template(DEFAULT_MODEL)  # as the router serves it
    return tok


def _accepts(matcher, tokenizer, text: str) -> bool:
    return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))


def test_structural_tag_frees_text_and_holds_calls(tokenizer):
    from pdserve.engine.structured_output import StructuredOutputs  # heavy: torch and xgrammar
    outputs = StructuredOutputs(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
    spec = tool_call_spec(tool_plan([WEATHER, TIME], None), "hermes", set(), checked_spec)
    bitmask = outputs._bitmask_for(1)
    matcher = outputs.new_matcher(spec, ())
    assert _accepts(matcher, tokenizer, "Sure, <b>some</b> {free} text: 1 < 2.")
    matcher.fill_next_token_bitmask(bitmask, 0)
    allowed = sum(bin(w & 0xFFFFFFFF).count("1") for w in bitmask[0].tolist())
    specials = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special} - {tokenizer.eos_token_id}
    assert allowed == len(tokenizer) - len(specials)  # before a call: every token but the special ones
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n</tool_call>'
    assert _accepts(matcher, tokenizer, call)
    assert matcher.accept_token(tokenizer.eos_token_id)
    # The calls end the turn: after one, another call or the stop token, never more text.
    assert not _accepts(outputs.new_matcher(spec, ()), tokenizer, call + "\nSure, it is sunny.")
    for bad in ('<tool_call>\n{"name": "Paris", ', '<tool_call>\n{"name": "get_time", "arguments": {"zone": "EST"',
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}'):
        assert not _accepts(outputs.new_matcher(spec, ()), tokenizer, bad), bad
    llama = tool_call_spec(tool_plan([WEATHER, TIME], None), "llama3_json", set(), checked_spec)
    assert _accepts(outputs.new_matcher(llama, ()), tokenizer, 'Ok. {"name": "get_time", "parameters": {"zone": "UTC"}}')
    assert not _accepts(outputs.new_matcher(llama, ()), tokenizer, '{"name": "get_time", "parameters": {"zone": 1')
    # A special token inside a format's markers that is no known marker: the call could never open.
    assert tool_call_spec(tool_plan([WEATHER], None), "mistral", {"TOOL"}, checked_spec) is None


def test_a_marker_that_is_a_special_token_opens_a_held_call():
    """Mistral's [TOOL_CALLS] is a special token, which every grammar's vocabulary leaves out (the
    text drops special tokens): the tool-call tag is compiled with it kept, so the model can open a
    call with it and the call is held to the tools; the router keeps it in the text, where the
    parser reads it. Other grammars still never allow it."""
    tok = load_tokenizer(resolve_model_path(DEFAULT_MODEL))
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    marker = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    outputs = _outputs(tok)
    spec = tool_call_spec(tool_plan([WEATHER, TIME], None), "mistral", {"[TOOL_CALLS]"}, checked_spec)
    call = tok.encode('[{"name": "get_time", "arguments": {"zone": "UTC"}}]', add_special_tokens=False)
    ids = tok.encode("Let me check. ", add_special_tokens=False) + [marker] + call
    matcher = outputs.new_matcher(spec, ())
    assert all(matcher.accept_token(t) for t in ids) and matcher.accept_token(tok.eos_token_id)
    content, calls = MistralParser().extract(tok.decode(ids, skip_special_tokens=False))
    assert content == "Let me check." and [(c.name, c.arguments) for c in calls] == [("get_time", '{"zone": "UTC"}')]
    matcher = outputs.new_matcher(spec, ())
    assert matcher.accept_token(marker) and not _accepts(matcher, tok, '[{"name": "Paris"')
    string = outputs.new_matcher(checked_spec("json", '{"type": "string"}'), ())
    assert string.accept_token(tok.encode('"', add_special_tokens=False)[0]) and not string.accept_token(marker)


def test_strict_false_keeps_the_schema_it_can_and_any_object_where_it_cannot(tokenizer):
    """`strict: false` (or absent): the schema still holds a call where xgrammar builds it; where it
    cannot (a lookbehind), the call is any JSON object instead of a 400, which `strict: true` is."""
    from pdserve.engine.structured_output import StructuredOutputs  # heavy: torch and xgrammar
    outputs = StructuredOutputs(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
    loose_time = {"type": "function", "function": {**TIME["function"], "strict": False}}
    odd = {"type": "object", "properties": {"code": {"type": "string", "pattern": "(?<=a)b"}}, "required": ["code"]}
    odd_tool = {"type": "function", "function": {"name": "lookup", "strict": False, "parameters": odd}}
    spec = tool_call_spec(tool_plan([loose_time, odd_tool], None), "hermes", set(), checked_spec)
    call = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'
    assert _accepts(outputs.new_matcher(spec, ()), tokenizer, call.format("get_time", '{"zone": "UTC"}'))
    assert not _accepts(outputs.new_matcher(spec, ()), tokenizer, call.format("get_time", '{"zone": "EST"}'))
    assert _accepts(outputs.new_matcher(spec, ()), tokenizer, call.format("lookup", '{"anything": [1, 2]}'))
    strict_odd = {"type": "function", "function": {**odd_tool["function"], "strict": True}}
    with pytest.raises(ValueError, match="Lookbehind"):
        tool_call_spec(tool_plan([strict_odd], None), "hermes", set(), checked_spec)


def _outputs(tokenizer):
    from pdserve.engine.structured_output import StructuredOutputs  # heavy: torch and xgrammar
    return StructuredOutputs(tokenizer, len(tokenizer), {tokenizer.eos_token_id})


PARALLEL = {  # two calls in one turn as each family writes them, and its parser
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>', HermesParser()),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET"}}', Llama3JsonParser()),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]', MistralParser()),
}


@pytest.mark.parametrize("family", sorted(PARALLEL))
def test_parallel_tool_calls_each_held_to_a_tool(tokenizer, family):
    """parallel_tool_calls true (OpenAI's default): one turn may make several calls, each of a
    declared tool with valid arguments, joined as the family's parser reads them; false: the turn
    ends after its first call."""
    outputs = _outputs(tokenizer)
    text, parser = PARALLEL[family]
    spec = tool_call_spec(tool_plan([WEATHER, TIME], None), family, set(), checked_spec)
    matcher = outputs.new_matcher(spec, ())
    assert _accepts(matcher, tokenizer, text) and matcher.accept_token(tokenizer.eos_token_id)
    assert [(c.name, json.loads(c.arguments)) for c in parser.extract(text)[1]] == [
        ("get_weather", {"city": "Rome", "unit": "celsius"}), ("get_time", {"zone": "CET"})]
    second_bad = text.replace('"zone": "CET"', '"zone": "EST"')
    assert not _accepts(outputs.new_matcher(spec, ()), tokenizer, second_bad)
    one = tool_call_spec(tool_plan([WEATHER, TIME], None, parallel=False), family, set(), checked_spec)
    assert not _accepts(outputs.new_matcher(one, ()), tokenizer, text)
    # At most MAX_PARALLEL_CALLS: a small model that repeats its call stops there, its calls whole.
    first = parser.extract(text)[1][0]
    many = tool_call_spec(tool_plan([WEATHER], None), family, set(), checked_spec)
    matcher = outputs.new_matcher(many, ())
    repeated = _repeat_call(family, first.arguments, MAX_PARALLEL_CALLS)
    assert _accepts(matcher, tokenizer, repeated) and matcher.accept_token(tokenizer.eos_token_id)
    assert not _accepts(outputs.new_matcher(many, ()), tokenizer, _repeat_call(family, first.arguments,
                                                                                 MAX_PARALLEL_CALLS + 1))


def _repeat_call(family: str, arguments: str, n: int) -> str:
    if family == "hermes":
        block = f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'
        return "\n".join([block] * n)
    if family == "llama3_json":
        return "; ".join([f'{{"name": "get_weather", "parameters": {arguments}}}'] * n)
    return "[TOOL_CALLS][" + ", ".join([f'{{"name": "get_weather", "arguments": {arguments}}}'] * n) + "]"


class Node(BaseModel):
    label: Literal["a", "b"]
    child: Node | None = None  # a model that refers to itself


def test_nested_and_recursive_pydantic_tools_under_auto_and_named(tokenizer):
    """What openai.pydantic_function_tool writes for nested models ($defs, $ref) and a model that
    refers to itself: under "auto" an opened call and under a named tool_choice the arguments
    follow the definitions, at any depth (tool_choice "required": test_tool_choice.py)."""
    outputs = _outputs(tokenizer)
    resident, node = openai.pydantic_function_tool(Resident), openai.pydantic_function_tool(Node)
    assert "$defs" in resident["function"]["parameters"] and "$ref" in json.dumps(node["function"]["parameters"])
    cases = [(resident, '{"name": "ada", "home": {"city": "Rome", "floor": 2}}',
              '{"name": "ada", "home": {"city": "Rome", "floor": 3}}'),
             (node, '{"label": "a", "child": {"label": "b", "child": {"label": "a", "child": null}}}',
              '{"label": "a", "child": {"label": "b", "child": {"label": "c", "child": null}}}')]
    auto = tool_call_spec(tool_plan([resident, node], None), "hermes", set(), checked_spec)
    for tool, good, bad in cases:
        name = tool["function"]["name"]
        jsonschema.validate(json.loads(good), tool["function"]["parameters"])
        call = '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>'
        assert _accepts(outputs.new_matcher(auto, ()), tokenizer, call % (name, good))
        assert not _accepts(outputs.new_matcher(auto, ()), tokenizer, call % (name, bad))
        named = checked_spec(*tool_plan([resident, node], {"type": "function", "function": {"name": name}}).grammar())
        assert _accepts(outputs.new_matcher(named, ()), tokenizer, good)
        assert not _accepts(outputs.new_matcher(named, ()), tokenizer, bad)


@pytest.fixture(scope="module")
def client(default_model_cluster):
    """`pdserve up` with no flags, the default model: conftest's cluster, shared with the other
    modules that only send it requests (these tests send only chat and completion requests)."""
    return openai.OpenAI(base_url=f"{default_model_cluster}/v1", api_key="none", max_retries=0, timeout=300)


def _ask(client, prompt: str, tools: list[dict]):
    return client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": prompt}],
                                          tools=tools, temperature=0, max_tokens=64).choices[0]


def test_every_call_names_a_declared_tool_with_valid_arguments(client):
    with ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(lambda case: _ask(client, *case), CASES))
    called = 0
    for (prompt, tools), choice in zip(CASES, choices):
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        for call in choice.message.tool_calls or []:
            assert call.function.name in schemas, (prompt, call)
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        if choice.message.tool_calls:
            called += 1
            # "length": max_tokens cut off a later call of several (parallel_tool_calls)
            assert choice.finish_reason in ("tool_calls", "length"), (prompt, choice)
        elif choice.finish_reason != "length":  # (a call max_tokens cut off stays text)
            assert "<tool_call>" not in (choice.message.content or ""), (prompt, choice)  # no unparsed call
    assert called >= len(CASES) // 2, f"only {called} of {len(CASES)} answers called a tool"


def test_streamed_call_ends_the_turn(client):
    stream = client.chat.completions.create(model=DEFAULT_MODEL, tools=[WEATHER], temperature=0, max_tokens=64,
                                            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                                            stream=True)
    chunks = list(stream)
    calls = [c for chunk in chunks for d in chunk.choices for c in d.delta.tool_calls or []]
    assert [c.function.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


EXACT_PROMPTS = ["Write a haiku about autumn leaves.", "Hi! How are you today?",
                 "Explain in two sentences why the sky is blue.", "Give me three names for a pet goldfish.",
                 "What is the capital of Italy?", "Translate 'good morning' into Spanish."]


def test_text_without_a_call_equals_the_unconstrained_completion(client, tokenizer):
    compared = 0
    for prompt in EXACT_PROMPTS:  # one at a time: each run meets the same (empty) batch
        messages = [{"role": "user", "content": prompt}]
        chat = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, tools=[CALC],
                                              temperature=0, max_tokens=40).choices[0]
        if chat.message.tool_calls or "<tool_call" in (chat.message.content or ""):
            continue  # a call opened: the constraint is meant to act there
        text, _ = render_chat_prompt(tokenizer, messages, [CALC])  # the chat's own prompt, no constraint
        ids = tokenizer.encode(text, add_special_tokens=False)
        plain = client.completions.create(model=DEFAULT_MODEL, prompt=ids, temperature=0, max_tokens=40).choices[0]
        assert chat.message.content == plain.text and chat.finish_reason == plain.finish_reason, prompt
        compared += 1
    assert compared >= 3, f"only {compared} prompts answered without a call"
