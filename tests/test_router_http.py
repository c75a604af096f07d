"""The router's OpenAI-compatible HTTP layer, through a real uvicorn server and the official
`openai` client (httpx for raw error and SSE checks), plus a small run of pdserve.loadgen.bench.

The backend here is a deterministic stand-in (it echoes the prompt tokens reversed, one
StepOutput per token, and records params and aborts) because the HTTP layer is what is under
test: request parsing, errors, SSE framing, usage, n>1, abort on disconnect. The real engine
and the disaggregated cluster are tested end-to-end elsewhere. The tokenizer is real: a tiny
byte-level BPE trained offline with `tokenizers`, wrapped in PreTrainedTokenizerFast.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable

import httpx
import openai
import pytest
import uvicorn
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pdserve.loadgen.bench import BenchConfig, run_benchmark
from pdserve.protocol.outputs import StepOutput, TokenLogprob
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.router.dispatch.backend import BackendError
from pdserve.router.openai.chat_prompt import render_chat_prompt
from pdserve.router.routes.app import create_app

MODEL = "tiny-echo"
MAX_MODEL_LEN = 256
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CORPUS = ["hello world, this is a tiny corpus for a tiny tokenizer.",
          "the quick brown fox jumps over the lazy dog.",
          "streaming tokens over server sent events is what routers do."] * 20


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


class EchoBackend:
    """Stand-in GenerationBackend: yields the prompt reversed (cycled), finishing by length."""
    model_name = MODEL

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self.tokenizer = tokenizer
        self.reset()

    def reset(self) -> None:
        self.params: dict[str, SamplingParams] = {}
        self.salts: dict[str, str | None] = {}  # the cache_salt each request reached the backend with
        self.aborted: list[str] = []
        self.delay_s = 0.0
        self.fail: str | None = None  # "start" | "mid"

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, session: str | None = None, cache_salt: str | None = None,
                       adapter: str | None = None) -> AsyncIterator[StepOutput]:
        self.params[request_id] = params
        self.salts[request_id] = cache_salt
        if self.fail == "start":
            raise BackendError("no prefill nodes registered")
        source = prompt_token_ids[::-1]
        for i in range(params.max_tokens):
            if self.fail == "mid" and i == 2:
                raise BackendError("decode node went away")
            await asyncio.sleep(self.delay_s)
            yield self._step(request_id, source[i % len(source)], params, len(prompt_token_ids),
                             last=i == params.max_tokens - 1)

    def _step(self, rid: str, tid: int, params: SamplingParams, n_prompt: int,
              last: bool) -> StepOutput:
        lps = None
        if params.logprobs is not None:
            top = [(tid, -0.25), (0, -2.0)][:params.logprobs]
            lps = [TokenLogprob(tid, -0.25, top)]
        return StepOutput(rid, [tid], self.tokenizer.decode([tid]), last,
                          "length" if last else None, lps, n_prompt, num_cached_tokens=3)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def health(self) -> dict:
        return {"healthy": True, "nodes": 1}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    backend = EchoBackend(tokenizer)
    app = create_app(backend, tokenizer, MODEL, MAX_MODEL_LEN)
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.started, "uvicorn did not start"
    yield f"http://127.0.0.1:{port}", backend, tokenizer
    srv.should_exit = True
    thread.join(timeout=5)


@pytest.fixture()
def ctx(server):
    base, backend, tokenizer = server
    backend.reset()
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=10)
    return base, backend, tokenizer, client


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def _sse_events(text: str) -> list[dict | str]:
    events: list[dict | str] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_models_and_health(ctx):
    base, _, _, client = ctx
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(f"{base}/health")
    assert health.status_code == 200 and health.json()["healthy"] is True


def test_completion_stream_matches_non_stream(ctx):
    _, backend, tokenizer, client = ctx
    prompt = "hello world, the quick brown fox"
    n_prompt = len(tokenizer.encode(prompt))
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0)
    assert full.id.startswith("cmpl-") and full.object == "text_completion"
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 7 and full.usage.prompt_tokens == n_prompt
    assert full.usage.total_tokens == n_prompt + 7
    assert full.usage.prompt_tokens_details.cached_tokens == 3
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=7,
                                            stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text and text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_token_id_prompt_and_return_token_ids(ctx):
    base, _, _, _ = ctx
    body = {"model": MODEL, "prompt": [[5, 6, 7]], "max_tokens": 4, "return_token_ids": True}
    resp = httpx.post(f"{base}/v1/completions", json=body)
    assert resp.status_code == 200
    assert resp.json()["choices"][0]["token_ids"] == [7, 6, 5, 7]


def test_chat_stream_matches_non_stream(ctx):
    _, backend, tokenizer, client = ctx
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hello world"}]}]
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}],
        tokenize=False, add_generation_prompt=True)
    n_prompt = len(tokenizer.encode(rendered, add_special_tokens=False))
    full = client.chat.completions.create(model=MODEL, messages=messages,
                                          max_completion_tokens=6)
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.usage.prompt_tokens == n_prompt and full.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                 stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.total_tokens == n_prompt + 6


def test_chat_default_max_tokens_fills_context(ctx):
    _, backend, _, client = ctx
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert resp.usage.prompt_tokens + resp.usage.completion_tokens == MAX_MODEL_LEN


def test_no_chat_template_is_a_400():
    from pdserve.router.openai.errors import APIError
    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(APIError) as info:
        render_chat_prompt(tokenizer, [{"role": "user", "content": "hi"}])
    assert info.value.status == 400 and "--chat-template" in info.value.message


def test_n2_seed_and_stop_forwarded(ctx):
    _, backend, _, client = ctx
    resp = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, n=2, seed=7,
                                     stop=["fox", "dog"])
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert resp.usage.completion_tokens == 6
    p0, p1 = backend.params[f"{resp.id}-0"], backend.params[f"{resp.id}-1"]
    assert (p0.seed, p1.seed) == (7, 8) and p0.stop == ["fox", "dog"]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, n=2,
        stream=True))
    assert {c.choices[0].index for c in chunks} == {0, 1}


def test_logprobs_shapes(ctx):
    _, _, _, client = ctx
    comp = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 3
    assert lp.text_offset[0] == 0 and lp.token_logprobs[0] == -0.25
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=2, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 2 and len(content[0].top_logprobs) == 2
    assert content[0].bytes == list(content[0].token.encode())


@pytest.mark.parametrize("extra", [{"temperature": -1}, {"max_tokens": 0}, {"n": 0},
                                   {"prompt": ["a", []]}, {"prompt_logprobs": 21},
                                   {"presence_penalty": 2.5}, {"prompt": [100000]}])
def test_completion_bad_values_400(ctx, extra):
    base = ctx[0]
    resp = httpx.post(f"{base}/v1/completions",
                      json={"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert set(err) == {"message", "type", "param", "code"}


def test_raw_errors(ctx):
    base, _, _, client = ctx
    bad_json = httpx.post(f"{base}/v1/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert bad_json.status_code == 400
    assert bad_json.json()["error"]["type"] == "invalid_request_error"
    no_messages = httpx.post(f"{base}/v1/chat/completions", json={"model": MODEL})
    assert no_messages.status_code == 400 and no_messages.json()["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="other-model", prompt="hi", max_tokens=2)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hello " * 300, max_tokens=2)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=MAX_MODEL_LEN)


def test_stream_disconnect_aborts(ctx):
    base, backend, _, _ = ctx
    backend.delay_s = 0.02
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 200, "stream": True}
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", f"{base}/v1/completions", json=body) as resp:
            rid = resp.headers["x-request-id"]
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
    assert _wait_for(lambda: f"{rid}-0" in backend.aborted), backend.aborted


def test_non_stream_disconnect_aborts(ctx):
    base, backend, _, _ = ctx
    backend.delay_s = 0.02
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 200}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/completions", json=body, timeout=0.3)
    started = list(backend.params)
    assert len(started) == 1 and started[0].startswith("cmpl-")
    assert _wait_for(lambda: started[0] in backend.aborted), backend.aborted


def test_backend_error_non_stream_503(ctx):
    base, backend, _, client = ctx
    backend.fail = "start"
    resp = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert resp.status_code == 503
    assert resp.json()["error"]["type"] == "server_error"
    assert "no prefill nodes" in resp.json()["error"]["message"]
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2)


def test_backend_error_mid_stream_error_chunk(ctx):
    base, backend, _, client = ctx
    backend.fail = "mid"
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 10, "stream": True}
    resp = httpx.post(f"{base}/v1/completions", json=body, timeout=10)
    events = _sse_events(resp.text)
    assert resp.status_code == 200 and events[-1] == "[DONE]"
    assert "decode node went away" in events[-2]["error"]["message"]
    assert sum(1 for e in events if isinstance(e, dict) and "choices" in e) == 2
    with pytest.raises(openai.APIError):
        list(client.completions.create(model=MODEL, prompt="hi", max_tokens=10, stream=True))


def test_bench_against_stand_in(ctx, tmp_path):
    base, _, tokenizer, _ = ctx
    out = tmp_path / "bench.json"
    cfg = BenchConfig(base_url=base, workload="random", num_prompts=4, input_len_min=4,
                      input_len_max=12, output_len=5, concurrency=2, num_warmup=1,
                      min_token_id=1, max_token_id=len(tokenizer), goodput_ttft_ms=10_000,
                      output_json=str(out), disable_tqdm=True)
    report = asyncio.run(run_benchmark(cfg))
    assert report["completed"] == 4 and report["failed"] == 0
    assert report["total_output_tokens"] == 20
    assert json.loads(out.read_text())["completed"] == 4
    for key in ("ttft", "tpot", "itl", "e2e"):
        for stat in ("mean", "p50", "p90", "p99"):
            assert report[f"{stat}_{key}_ms"] is not None
    assert report["p99_ttft_ms"] <= report["p99_e2e_ms"]
    assert report["mean_ttft_ms"] <= report["mean_e2e_ms"]
    assert report["goodput"] > 0 and report["request_throughput"] > 0
    multi = asyncio.run(run_benchmark(BenchConfig(
        base_url=base, workload="multi-round", num_users=2, num_rounds=2, input_len_min=3,
        input_len_max=3, output_len=2, min_token_id=1, max_token_id=len(tokenizer),
        num_warmup=0, request_rate=100.0, disable_tqdm=True)))
    assert multi["completed"] == 4
    # Round 2 resends round 1's prompt (3) + answer (2) + a new question (3).
    assert multi["total_input_tokens"] == 2 * (3 + 8)


@pytest.mark.parametrize("prompt_kind", ["text", "ids"])
def test_echo_prepends_the_prompt_streamed_and_not(ctx, prompt_kind):
    _, _, tokenizer, client = ctx
    text = "the quick brown fox"
    prompt = text if prompt_kind == "text" else tokenizer.encode(text)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4).choices[0].text
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True).choices[0].text
    assert echoed == tokenizer.decode(tokenizer.encode(text)) + plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, echo=True, stream=True))
    assert streamed == echoed


def test_tokenize_and_detokenize_match_the_tokenizer(ctx):
    base, _, tokenizer, _ = ctx
    text = "hello world, the lazy dog"
    r = httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_MODEL_LEN
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    messages = [{"role": "user", "content": "hi there"}]
    chat = httpx.post(f"{base}/tokenize", json={"messages": messages}).json()
    want, _ = render_chat_prompt(tokenizer, messages)
    assert chat["tokens"] == tokenizer.encode(want, add_special_tokens=False)
    back = httpx.post(f"{base}/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"] == tokenizer.decode(body["tokens"])


@pytest.mark.parametrize("path,payload", [
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}),
    ("/tokenize", {}),
    ("/tokenize", {"prompt": "x", "model": "other-model"}),
    ("/detokenize", {"tokens": [10**6]}),
    ("/detokenize", {"tokens": "nope"}),
])
def test_tokenize_bad_input_is_an_openai_error(ctx, path, payload):
    resp = httpx.post(f"{ctx[0]}{path}", json=payload)
    assert resp.status_code in (400, 404)
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


BAD_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}},
             {"type": "function", "function": {"name": "f", "parameters": '{"type": "object"}'}},
             {"type": "function", "function": {"name": "f", "parameters": {
                 "type": "object", "properties": {"unit": {"type": "string", "enum": []}}}}}]


@pytest.mark.parametrize("tool", BAD_TOOLS, ids=["bad-schema", "string", "empty-enum"])
@pytest.mark.parametrize("choice", [None, "auto", "none", "required", {"type": "function", "function": {"name": "f"}}])
def test_invalid_tool_schema_is_a_400_under_any_tool_choice(ctx, tool, choice):
    client = ctx[3]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       tools=[tool], **({} if choice is None else {"tool_choice": choice}))
    assert info.value.param == "tools" and "parameters" in info.value.message
    flat = {"type": "function", "name": "f", "parameters": tool["function"]["parameters"], "strict": False}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="hi", max_output_tokens=2, tools=[flat])
    assert info.value.param == "tools"


@pytest.mark.parametrize("stop", ["", [""], ["the", ""]])
def test_empty_stop_string_and_empty_responses_input_are_400s(ctx, stop):
    client = ctx[3]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, stop=stop)
    assert info.value.param == "stop"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       stop=stop)
    assert info.value.param == "stop"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="", max_output_tokens=2)
    assert info.value.param == "input"


# Valid JSON Schema that no grammar can be built from: a regex feature xgrammar lacks, an empty range.
UNBUILDABLE = [({"type": "string", "pattern": "(?<=a)b"}, "Lookbehind"),
               ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum greater than maximum")]


@pytest.mark.parametrize("schema,why", UNBUILDABLE, ids=["lookbehind", "empty-range"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "g"}}])
def test_unbuildable_tool_schema_names_tools_and_says_why(ctx, schema, why, choice):
    client = ctx[3]
    fine = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    bad = {"type": "function", "function": {"name": "g", "strict": True, "parameters": {
        "type": "object", "properties": {"x": schema}, "required": ["x"], "additionalProperties": False}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       tools=[fine, bad], tool_choice=choice)
    assert info.value.param == "tools", info.value.message
    assert "tools[1] ('g')" in info.value.message and why in info.value.message
