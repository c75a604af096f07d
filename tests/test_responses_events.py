"""The translation of chat deltas into Responses items and events (router/openai/responses_events.py),
checked strictly against the openai SDK's own types: the SDK's client parses leniently, so a
missing required field would pass the cluster tests unseen; pydantic's validation here does not
let it. The cluster side (real deltas from real nodes) is tests/test_responses_api.py."""
from __future__ import annotations

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from pdserve.router.openai.errors import backend_unavailable
from pdserve.router.openai.responses import ChoiceState
from pdserve.router.openai.responses_events import ResponseEvents, responses_usage

EVENT = TypeAdapter(ResponseStreamEvent)
BASE = {"id": "resp_1", "object": "response", "created_at": 1, "model": "m", "instructions": None,
        "max_output_tokens": None, "metadata": {}, "parallel_tool_calls": True, "previous_response_id": None,
        "store": True, "temperature": 1.0, "top_p": 1.0, "text": {"format": {"type": "text"}},
        "tool_choice": "auto", "tools": [], "truncation": "disabled", "user": None, "reasoning": None}


def _usage(output_tokens: int, cached: int = 0) -> dict:
    state = ChoiceState(0, token_ids=list(range(output_tokens)), num_cached_tokens=cached)
    return responses_usage(10, state)


def _run(deltas: list[dict], finish: str = "stop") -> tuple[list[dict], ResponseEvents]:
    events = ResponseEvents(dict(BASE))
    out = events.opening()
    for delta in deltas:
        out += events.delta(delta)
    out += events.closing(finish, _usage(len(deltas), cached=4))
    for event in out:
        EVENT.validate_python(event)  # every event, strictly, as the SDK declares it
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out, events


def test_text_deltas_become_one_message():
    out, events = _run([{"content": "Hel"}, {"content": "lo"}, {}])
    kinds = [e["type"] for e in out]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    final = Response.model_validate(out[-1]["response"])
    assert final.output_text == "Hello" and final.status == "completed"
    assert final.usage.input_tokens_details.cached_tokens == 4 and final.usage.total_tokens == 13
    assert events.assistant_message() == {"role": "assistant", "content": "Hello"}


def test_text_then_parsed_calls_close_the_message_first():
    calls = [{"index": i, "id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
             for i, (n, a) in enumerate([("f", '{"x": 1}'), ("g", "{}")])]
    out, events = _run([{"content": "Let me check. "}, {"tool_calls": calls}])
    kinds = [e["type"] for e in out]
    assert kinds.index("response.output_item.done") < kinds.index("response.function_call_arguments.done")
    final = Response.model_validate(out[-1]["response"])
    assert [o.type for o in final.output] == ["message", "function_call", "function_call"]
    assert [(o.call_id, o.name, o.arguments) for o in final.output[1:]] == [("call_0", "f", '{"x": 1}'),
                                                                             ("call_1", "g", "{}")]
    assert events.assistant_message()["tool_calls"][1] == {"id": "call_1", "type": "function",
                                                          "function": {"name": "g", "arguments": "{}"}}


def test_named_call_streams_its_arguments():
    first = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"ci'}}
    out, _ = _run([{"tool_calls": [first]}, {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": 1}'}}]}])
    deltas = [e["delta"] for e in out if e["type"] == "response.function_call_arguments.delta"]
    done = next(e for e in out if e["type"] == "response.function_call_arguments.done")
    assert "".join(deltas) == done["arguments"] == '{"city": 1}'
    assert not any(e["type"].startswith("response.output_text") for e in out)


@pytest.mark.parametrize("finish,status", [("stop", "completed"), ("length", "incomplete")])
def test_an_empty_answer_is_an_empty_message(finish, status):
    out, _ = _run([], finish)
    final = Response.model_validate(out[-1]["response"])
    assert final.status == status and final.output_text == "" and len(final.output) == 1
    assert out[-1]["type"] == ("response.completed" if status == "completed" else "response.incomplete")
    if status == "incomplete":
        assert final.incomplete_details.reason == "max_output_tokens" and final.output[0].status == "incomplete"


def test_a_failure_is_an_error_event_then_response_failed():
    events = ResponseEvents(dict(BASE))
    out = events.opening() + events.delta({"content": "partial"}) + events.failure(backend_unavailable(
        RuntimeError("no decode node")))
    for event in out:
        EVENT.validate_python(event)
    assert [e["type"] for e in out[-2:]] == ["error", "response.failed"]
    assert out[-2]["code"] == "service_unavailable"
    failed = Response.model_validate(out[-1]["response"])
    assert failed.status == "failed" and failed.error.code == "server_error" and "no decode node" in failed.error.message
