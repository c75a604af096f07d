"""Clients nobody here wrote, against a real 1P1D cluster (`pdserve up` over NIXL, served with
--chat-template): lm-evaluation-harness's `local-completions` (loglikelihood tasks through
batched echo + logprobs + max_tokens 0) against lm-eval's own `hf` model on the same weights;
LangChain's with_structured_output (json_schema, function_calling) and bind_tools
(tool_choice="any"); LiteLLM with tool_choice="auto" over two turns; and through the official
openai client, batched prompts (greedy equal to the offline engine, streamed and not) and each
tool_choice, with a model made to write a Hermes call so that "auto" parses a real one."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

from pdserve import LLM, SamplingParams
from pdserve.testing.model_factory import make_model
from pdserve.testing.nested_tools import Resident
from pdserve.testing.up_cluster import running_cluster

TOOLS_TEMPLATE = """{%- if tools %}<|system|>Call a tool by writing <tool_call>{"name": NAME, "arguments": {...}}\
</tool_call>. Tools:
{% for t in tools %}{{ t | tojson }}
{% endfor %}{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' and m.tool_calls -%}
<|assistant|>{{ m.content or '' }}{% for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", \
"arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}
{% elif m.role == 'tool' -%}
<|tool|>{{ m.content }}
{% else -%}
<|{{ m.role }}|>{{ m.content }}
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|assistant|>{% endif -%}"""
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "additionalProperties": False,
                                                           "properties": {"city": {"enum": ["Paris", "Rome"]}},
                                                           "required": ["city"]}}}
HERMES_CALL = r'Checking\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}</tool_call>'


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("clients")
    path = make_model(root, "llama", seed=11)
    template = root / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    with running_cluster("--model", str(path), "--kv-transfer", "nixl", "--chat-template", str(template)) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        yield str(path), url, client, root


def _rendered_tokens(model: str, messages: list[dict], tools: list[dict] | None) -> int:
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = TOOLS_TEMPLATE
    return len(tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True,
                                             return_dict=True)["input_ids"])


def test_batched_prompts_indexed_prompt_major(served):
    model, _, client, _ = served
    texts = ["The first prompt", "A second, longer prompt than the first", "3"]
    ids = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45], [9]]
    llm = LLM(model, num_kv_blocks=256)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for prompt in (texts, ids):
        want = [o.outputs[0].text for o in llm.generate(
            [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt], params, use_tqdm=False)]
        resp = client.completions.create(model=model, prompt=prompt, n=2, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True})
        by_index = {c.index: c.text for c in resp.choices}
        assert by_index == {i * 2 + j: want[i] for i in range(len(prompt)) for j in range(2)}
        assert resp.usage.completion_tokens == 6 * 2 * len(prompt)
        prompt_tokens = sum(len(p) for p in ids) if prompt is ids else sum(
            len(llm.get_tokenizer().encode(t)) for t in texts)
        assert resp.usage.prompt_tokens == prompt_tokens
        streamed: dict[int, str] = {}
        for chunk in client.completions.create(model=model, prompt=prompt, n=2, max_tokens=6, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}):
            for choice in chunk.choices:
                streamed[choice.index] = streamed.get(choice.index, "") + choice.text
        assert streamed == by_index


def test_tool_choice_required_named_and_auto(served):
    model, _, client, _ = served
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    required = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER],
                                              tool_choice="required", max_tokens=200, temperature=0)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    named = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=200,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(named.choices[0].message.tool_calls[0].function.arguments)["city"] in ("Paris", "Rome")
    # auto (the default with tools): the tools are in the prompt; this model answers in text.
    auto = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=8,
                                          temperature=0)
    assert auto.usage.prompt_tokens == _rendered_tokens(model, messages, [WEATHER])
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].message.content
    # A model that writes a Hermes call (made to, by a regex): auto parses it, streamed and not.
    forced = {"structured_outputs": {"regex": HERMES_CALL}}
    auto = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=120,
                                          temperature=0, extra_body=forced)
    message = auto.choices[0].message
    assert auto.choices[0].finish_reason == "tool_calls" and message.content == "Checking."
    assert message.tool_calls[0].function.name == "get_weather"
    chunks = list(client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=120,
                                                 temperature=0, extra_body=forced, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Checking. "
    streamed = [tc for d in deltas for tc in d.tool_calls or []]
    assert len(streamed) == 1 and streamed[0].function.arguments == message.tool_calls[0].function.arguments


def test_nested_pydantic_tools_under_each_tool_choice(served):
    """openai.pydantic_function_tool writes a nested model as $defs and $refs (strict): every
    tool_choice answers, in chat and in the Responses API, and each call is valid against the tool's
    schema. (Under "required" the
    grammar nests each tool's schema in one of all the calls, where its $refs must still resolve;
    test_tool_choice.py has two tools' definitions side by side, and a recursive one: a random
    model recurses until the context runs out, so none here.)"""
    model, _, client, _ = served
    messages = [{"role": "user", "content": "Who lives in Rome?"}]
    resident = openai.pydantic_function_tool(Resident)
    cases = [([resident], "required"), ([resident], {"type": "function", "function": {"name": "Resident"}}),
             ([resident], "auto")]
    for tools, choice in cases:
        schema = tools[0]["function"]["parameters"]
        assert "$defs" in schema and schema["additionalProperties"] is False
        answer = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice=choice,
                                                temperature=0)  # max_tokens: the rest of the context
        calls = answer.choices[0].message.tool_calls or []
        assert calls or choice == "auto", (choice, answer.choices[0])
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), schema)
    # The Responses API, whose flat tools take the same schema.
    flat = {"type": "function", **resident["function"]}
    response = client.responses.create(model=model, input=messages, tools=[flat], tool_choice="required",
                                       temperature=0)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(c.name == "Resident" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), flat["parameters"])


def test_grammar_dead_end_on_either_node(served):
    """bad_words bars the only token the choice allows: on the decode node (after "a") and on
    the prefill node (the first token). The answer says so instead of a plain "stop"."""
    model, _, client, _ = served
    for choice, text in ((["ab"], "a"), (["b"], "")):
        resp = client.completions.create(model=model, prompt="hello", max_tokens=8, temperature=0,
                                         extra_body={"guided_choice": choice, "bad_words": ["b"]})
        got = resp.choices[0]
        assert (got.text, got.finish_reason) == (text, "grammar_dead_end")
        assert "could not be continued" in got.model_extra["stop_reason"]


class Person(BaseModel):
    name: Literal["ada", "bob"]
    age: int = Field(ge=0, le=99)
    note: str = Field(max_length=12)


def test_langchain_structured_output_and_bind_tools(served):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    model, url, _, _ = served
    llm = ChatOpenAI(model=model, base_url=f"{url}/v1", api_key="none", temperature=0, max_tokens=200,
                     max_retries=0)
    for method in ("json_schema", "function_calling"):
        person = llm.with_structured_output(Person, method=method).invoke("Describe a person")
        assert isinstance(person, Person)

    @tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        return "sunny"

    message = llm.bind_tools([get_weather], tool_choice="any").invoke("Weather in Rome?")
    assert [c["name"] for c in message.tool_calls] == ["get_weather"]
    assert message.tool_calls[0]["args"]["city"] in ("Paris", "Rome")


def test_langchain_completion_batch(served):
    """LangChain's completion LLM sends its prompts as one batched `prompt` list."""
    from langchain_openai import OpenAI
    model, url, _, _ = served
    llm = OpenAI(model=model, base_url=f"{url}/v1", api_key="none", temperature=0, max_tokens=5, max_retries=0,
                 extra_body={"ignore_eos": True})
    prompts = ["one", "two two", "three three three"]
    got = [g[0].text for g in llm.generate(prompts).generations]
    want = [o.outputs[0].text for o in LLM(model, num_kv_blocks=64).generate(
        prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)]
    assert got == want


def test_litellm_tool_choice_auto_round_trip(served):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list
    import litellm
    model, url, _, _ = served
    kwargs = dict(model=f"openai/{model}", api_base=f"{url}/v1", api_key="none", tools=[WEATHER],
                  tool_choice="auto", temperature=0)
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    first = litellm.completion(messages=messages, max_tokens=120, extra_body={"structured_outputs": {"regex": HERMES_CALL}},
                               **kwargs)
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    # The call and its result go back as history; the template renders both.
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    second = litellm.completion(messages=messages, max_tokens=8, **kwargs)
    assert second.choices[0].message.content
    history = [{"role": "user", "content": "Weather in Rome?"},
               {"role": "assistant", "content": "Checking.", "tool_calls": [
                   {"id": call.id, "type": "function", "function": {
                       "name": "get_weather", "arguments": json.loads(call.function.arguments)}}]},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    assert second.usage.prompt_tokens == _rendered_tokens(model, history, [WEATHER])


LM_EVAL_TASKS = {
    "mc": ("multiple_choice", {"doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}",
                               "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc"}]}),
    "ppl": ("loglikelihood_rolling", {"doc_to_text": "", "doc_to_target": "{{text}}",
                                      "metric_list": [{"metric": "word_perplexity"}, {"metric": "bits_per_byte"}]}),
}
WORDS = "the cat sat on a mat while dogs ran over green hills near old stone walls".split()


def _lm_eval_tasks(root) -> list[str]:
    """Local-data tasks: 8 multiple-choice questions, 4 texts (each within one rolling window:
    lm-eval's two backends cut longer texts into windows one token apart)."""
    docs = {"mc": [{"question": " ".join(WORDS[(i + k) % len(WORDS)] for k in range(5 + i % 4)),
                    "choices": [" ".join(WORDS[(3 * i + j + k) % len(WORDS)] for k in range(2 + j)) for j in range(3)],
                    "answer": i % 3} for i in range(8)],
            "ppl": [{"text": " ".join(WORDS[(5 * i + k) % len(WORDS)] for k in range(20 + 30 * i))}
                    for i in range(4)]}
    names = []
    for key, (output_type, fields) in LM_EVAL_TASKS.items():
        data = root / f"{key}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs[key]))
        spec = {"task": f"pdserve_{key}", "dataset_path": "json", "test_split": "test", "output_type": output_type,
                "dataset_kwargs": {"data_files": {"test": str(data)}}, **fields}
        (root / f"{key}.yaml").write_text(json.dumps(spec))  # YAML is a superset of JSON
        names.append(spec["task"])
    return names


def _run_lm_eval(root, name: str, model: str, model_args: str, tasks: list[str]) -> dict[str, list]:
    out = root / name
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_CACHE": str(root / "datasets")}
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", ",".join(tasks),
           "--include_path", str(root), "--batch_size", "4", "--output_path", str(out), "--log_samples"]
    cmd += ["--device", "cpu"] if model == "hf" else []
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    samples = {}
    for task in tasks:
        path = glob.glob(str(out / "*" / f"samples_{task}_*.jsonl"))[0]
        samples[task] = [json.loads(line) for line in open(path)]
    return samples


def test_lm_eval_local_completions_equals_hf(served):
    """lm-eval's loglikelihood and loglikelihood_rolling requests (batched 4 at a time) served by
    pdserve give lm-eval's `hf` model's per-example loglikelihoods, and so its accuracy."""
    model, url, _, root = served
    tasks = _lm_eval_tasks(root)
    api = _run_lm_eval(root, "api", "local-completions",
                       f"model={model},base_url={url}/v1/completions,tokenizer={model},"
                       "tokenizer_backend=huggingface,num_concurrent=2,max_retries=1,max_length=1000", tasks)
    hf = _run_lm_eval(root, "hf", "hf", f"pretrained={model},dtype=float32,max_length=1000", tasks)
    for task in tasks:
        assert len(api[task]) == len(hf[task]) > 0
        for got, want in zip(sorted(api[task], key=lambda s: s["doc_id"]), sorted(hf[task], key=lambda s: s["doc_id"])):
            got_ll = [float(r[0][0] if isinstance(r[0], list) else r[0]) for r in got["resps"]]
            want_ll = [float(r[0][0] if isinstance(r[0], list) else r[0]) for r in want["resps"]]
            # Sums over up to ~650 tokens: float32 rounding grows with the count (1e-4 per token).
            assert got_ll == pytest.approx(want_ll, abs=1e-4, rel=1e-6)
            assert got.get("acc") == want.get("acc")
