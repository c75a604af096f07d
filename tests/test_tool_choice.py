"""tool_choice without a cluster: what each choice asks of the output, the tool-call formats of
the chat templates (Hermes, Llama 3 JSON, Mistral) parsed out of text, and the streamed deltas'
shape. The end-to-end checks (a model writing the calls, LangChain and LiteLLM) are in
test_clients.py."""
from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.protocol.outputs import StepOutput
from pdserve.router.openai.responses import ChoiceState
from pdserve.router.openai.structured_request import tool_plan
from pdserve.router.openai.tool_calls import ParsedToolCallChatFlavor
from pdserve.router.openai.tool_parsers import HermesParser, Llama3JsonParser, MistralParser, parser_for, required_calls

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}


def test_tool_choice_plans_as_openai_defines_them():
    assert tool_plan([WEATHER], None).mode == "auto"  # tools without tool_choice: auto, as OpenAI
    assert tool_plan(None, None) is None and tool_plan([WEATHER], "none") is None
    assert tool_plan([WEATHER], "auto").grammar() is None
    named = tool_plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert named.mode == "named" and json.loads(named.grammar()[1])["properties"]["zone"]["enum"] == ["utc", "cet"]
    for bad in ("any", {"type": "function", "function": {"name": "nope"}}):
        with pytest.raises(ValueError):
            tool_plan([WEATHER], bad)
    with pytest.raises(ValueError):
        tool_plan(None, "required")
    with pytest.raises(ValueError):
        tool_plan([{"type": "function"}], "auto")


def test_required_grammar_accepts_exactly_calls_of_the_tools():
    kind, schema = tool_plan([WEATHER, TIME], "required").grammar()
    schema = json.loads(schema)
    good = [{"name": "get_time", "parameters": {"zone": "utc"}},
            {"name": "get_weather", "parameters": {"city": "Oslo"}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_time", "parameters": {"zone": "pst"}}], [{"name": "rm", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    calls = required_calls(json.dumps(good))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"zone": "utc"}),
                                                                  ("get_weather", {"city": "Oslo"})]
    assert required_calls('[{"name": "get_time", "parameters": {"zo') == []  # cut off by max_tokens


# What openai.pydantic_function_tool writes for nested pydantic models: refs into the tool's $defs
# (Address, a "Ship" defined under a name another tool uses too), and a tree that refers to its root.
_ADDRESS = {"type": "object", "properties": {"street": {"type": "string"}}, "required": ["street"]}
PERSON = {"type": "function", "function": {"name": "person", "parameters": {
    "$defs": {"Address": _ADDRESS, "Ship": {"type": "integer"}}, "type": "object",
    "properties": {"home": {"$ref": "#/$defs/Address"}, "ship": {"$ref": "#/$defs/Ship"}}, "required": ["home"]}}}
FLEET = {"type": "function", "function": {"name": "fleet", "parameters": {
    "definitions": {"Ship": {"type": "string", "enum": ["ark"]}}, "type": "object",
    "properties": {"ship": {"$ref": "#/definitions/Ship"}, "escort": {"$ref": "#"}}, "required": ["ship"]}}}


def test_required_grammar_keeps_each_tools_definitions():
    """Under "required" each tool's parameters sit inside one schema of all the calls: their $defs
    (and definitions, and a root "#") must still resolve, each tool's to its own."""
    from pdserve.router.openai.structured_request import checked_spec
    kind, text = tool_plan([PERSON, FLEET], "required").grammar()
    checked_spec(kind, text)  # xgrammar builds it
    schema = json.loads(text)
    good = [{"name": "person", "parameters": {"home": {"street": "Rue"}, "ship": 3}},
            {"name": "fleet", "parameters": {"ship": "ark", "escort": {"ship": "ark"}}}]
    jsonschema.validate(good, schema)
    for bad in ([{"name": "person", "parameters": {"home": {"street": 1}}}],
                [{"name": "person", "parameters": {"home": {"street": "Rue"}, "ship": "ark"}}],
                [{"name": "fleet", "parameters": {"ship": "ark", "escort": {"ship": "raft"}}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


@pytest.mark.parametrize("parser,text,content,calls", [
    (HermesParser(), 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Rome"})]),
    (HermesParser(), '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": '
     '{"x": 1}}</tool_call>', "", [("a", {}), ("b", {"x": 1})]),
    (HermesParser(), "no call here", "no call here", []),
    (HermesParser(), "<tool_call>{not json</tool_call>", "<tool_call>{not json</tool_call>", []),
    (Llama3JsonParser(), '{"name": "get_weather", "parameters": {"city": "Rome"}}', "",
     [("get_weather", {"city": "Rome"})]),
    (Llama3JsonParser(), '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"y": 2}}',
     "", [("a", {}), ("b", {"y": 2})]),
    (Llama3JsonParser(), "{ just braces", "{ just braces", []),
    (MistralParser(), 'Sure [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]', "Sure",
     [("get_weather", {"city": "Rome"})]),
])
def test_parsers_extract_calls(parser, text, content, calls):
    got_content, got = parser.extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") for c in got) and len({c.id for c in got}) == len(got)


def test_parser_follows_the_chat_template():
    assert parser_for(None, "{{ '<tool_call>' }}").name == "hermes"
    assert parser_for(None, "[TOOL_CALLS] {{ tools }}").name == "mistral"
    assert parser_for(None, "<|python_tag|>{{ x }}<|eom_id|>").name == "llama3_json"
    assert parser_for("mistral", "<tool_call>").name == "mistral"
    with pytest.raises(ValueError):
        parser_for("nope", None)


def test_content_streams_until_a_call_may_begin():
    hermes = HermesParser()
    assert hermes.content_end("Hello <tool") == len("Hello ")  # may be the marker: held back
    assert hermes.content_end("Hello <b>") == len("Hello <b>")
    assert hermes.content_end("Hi <tool_call>{") == len("Hi ")
    llama = Llama3JsonParser()
    assert llama.content_end("  {") == 0 and llama.content_end("Plain answer") == len("Plain answer")


def _stream(flavor, pieces: list[str], finish: str = "stop") -> list[dict]:
    state = ChoiceState(0)
    chunks = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        out = StepOutput("r", [i], piece, last, finish if last else None)
        chunks.append(flavor.chunk_choice(state, out))
        state.add(out)
    return chunks


def test_auto_stream_shape_follows_openai():
    flavor = ParsedToolCallChatFlavor(lambda t: str(t), False, False, HermesParser())
    pieces = ["Let", " me", " look <tool", '_call>{"name": "get_weather", ', '"arguments": {"city": "Rome"}}',
              "</tool_call>"]
    chunks = _stream(flavor, pieces)
    content = "".join(c["delta"].get("content", "") for c in chunks)
    assert content == "Let me look "
    calls = [tc for c in chunks for tc in c["delta"].get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["type"] == "function"
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert chunks[-1]["finish_reason"] == "tool_calls"
    plain = _stream(ParsedToolCallChatFlavor(lambda t: str(t), False, False, HermesParser()), ["a <", "b", "c"])
    assert "".join(c["delta"].get("content", "") for c in plain) == "a <bc"
    assert plain[-1]["finish_reason"] == "stop" and not any("tool_calls" in c["delta"] for c in plain)


def test_required_response_and_stream_carry_the_calls():
    flavor = ParsedToolCallChatFlavor(lambda t: str(t), False, False, None)
    text = '[{"name": "get_time", "parameters": {"zone": "cet"}}]'
    state = ChoiceState(0)
    state.add(StepOutput("r", [1], text, True, "stop"))
    message = flavor.choice(state)
    assert message["finish_reason"] == "tool_calls" and message["message"]["content"] is None
    call = message["message"]["tool_calls"][0]
    assert call["function"] == {"name": "get_time", "arguments": '{"zone": "cet"}'}
    chunks = _stream(ParsedToolCallChatFlavor(lambda t: str(t), False, False, None), [text[:10], text[10:]])
    assert chunks[0]["delta"] == {} and chunks[-1]["delta"]["tool_calls"][0]["function"]["name"] == "get_time"


def test_parallel_tool_calls_false_allows_one_call():
    _, schema = tool_plan([WEATHER, TIME], "required", parallel=False).grammar()
    schema = json.loads(schema)
    one = [{"name": "get_time", "parameters": {"zone": "utc"}}]
    jsonschema.validate(one, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(one * 2, schema)
    assert "maxItems" not in json.loads(tool_plan([WEATHER], "required").grammar()[1])
    flavor = ParsedToolCallChatFlavor(None, False, False, HermesParser())
    flavor.max_calls = 1
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert [c.name for c in flavor._parse(text)[1]] == ["a"]


def test_required_array_cut_short_keeps_its_whole_calls():
    whole = '[{"name": "get_time", "parameters": {"zone": "utc"}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    for cut, names in ((len(whole), ["get_time", "get_weather"]), (len(whole) - 1, ["get_time", "get_weather"]),
                       (len(whole) - 10, ["get_time"]), (53, ["get_time"]), (52, ["get_time"]), (20, []), (0, [])):
        assert [c.name for c in required_calls(whole[:cut])] == names, cut
    state = ChoiceState(0)
    state.add(StepOutput("r", [1], whole[:60], True, "length"))
    body = ParsedToolCallChatFlavor(None, False, False, None).choice(state)
    assert body["finish_reason"] == "length" and [c["function"]["name"] for c in body["message"]["tool_calls"]] == ["get_time"]


@pytest.mark.parametrize(("parser", "text"), [
    (HermesParser(), '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
                     '<tool_call>\n{"name": "b", "arguments": {"x": 2}}\n</tool_call>\n<tool_call>\n{"name": "a", "argu'),
    (Llama3JsonParser(), '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"x": 2}}; {"name": "a", "pa'),
    (MistralParser(), '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"x": 2}}, {"na'),
])
def test_auto_calls_cut_short_keep_their_whole_calls(parser, text):
    """Under "auto" with parallel_tool_calls a turn may hold several calls (tool_tags.py); when
    max_tokens cuts the last one off, the whole ones before it are returned, as under "required",
    with finish_reason "length"; a lone call cut off stays text, as before."""
    content, calls = parser.extract(text)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {"x": 2})]
    state = ChoiceState(0)
    state.add(StepOutput("r", [1], text, True, "length"))
    body = ParsedToolCallChatFlavor(None, False, False, parser).choice(state)
    assert body["finish_reason"] == "length" and len(body["message"]["tool_calls"]) == 2
    lone = text[:text.index("}}") - 3]
    assert parser.extract(lone) == (lone, [])


def test_hermes_block_with_a_list_of_calls():
    text = '<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]</tool_call>'
    content, calls = HermesParser().extract(text)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {})]
