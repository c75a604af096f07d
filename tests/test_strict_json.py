"""Structured JSON that strict parsers accept, and constraints the vocabulary cannot meet refused.

Random-weight models sample (temperature 1) under JSON schemas whose strings are free,
length-bounded and patterned, and under json_object: every output must pass
json.loads(strict=True) and pydantic's model_validate_json, which refuse raw control
characters inside strings. A constraint no token of the vocabulary can start is a 400 from the
router, before any node generates; one met later ends with its own finish reason.
"""
from __future__ import annotations

import json
import threading
import time

import openai
import pytest
import uvicorn
from pydantic import BaseModel, Field
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pdserve import LLM, SamplingParams
from pdserve.protocol.sampling_params import StructuredSpec
from pdserve.router.routes.app import create_app
from pdserve.testing.model_factory import make_model
from pdserve.wire.transport import free_port


class Note(BaseModel):
    title: str = Field(max_length=16)
    body: str = Field(max_length=40)
    code: str = Field(min_length=2, max_length=8)
    tags: list[str] = Field(max_length=3)


SCHEMA = json.dumps(Note.model_json_schema())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sampled_json_is_strict_json(tmp_path, arch):
    """Length-bounded strings are where raw control characters got in (before the grammar was
    held to strict JSON, every one of these outputs failed json.loads(strict=True))."""
    llm = LLM(str(make_model(tmp_path, arch, seed=7)), num_kv_blocks=512)
    prompts = ["Write a note:", "\t\x01 control characters \x1f"]
    cases = [(StructuredSpec("json", SCHEMA), Note, 6), (StructuredSpec("json", '{"type": "object"}'), None, 2)]
    for spec, model, at_least in cases:
        params = [SamplingParams(max_tokens=200, temperature=t, seed=s, structured=spec)
                  for t in (1.0, 0.7) for s in range(5)]
        outs = llm.generate([p for p in prompts for _ in params], params * len(prompts), use_tqdm=False)
        texts = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
        assert len(texts) >= at_least, "too few outputs completed within max_tokens to judge"
        for text in texts:
            json.loads(text, strict=True)
            if model is not None:
                model.model_validate_json(text)


def test_grammar_dead_end_is_its_own_finish_reason(tmp_path):
    """A grammar with no drawable token left (here bad_words bars the only one it allows) ends
    the request with finish_reason "grammar_dead_end" and no stray text, not a plain "stop"."""
    llm = LLM(str(make_model(tmp_path, "llama", seed=5)), num_kv_blocks=64)
    barred = [llm.get_tokenizer().encode("b", add_special_tokens=False)]
    for choice, text in ((["ab"], "a"), (["b"], "")):
        params = SamplingParams(max_tokens=8, temperature=0, structured=StructuredSpec("choice", json.dumps(choice)),
                                bad_words_token_ids=barred)
        out = llm.generate(["hello"], params, use_tqdm=False)[0].outputs[0]
        assert (out.text, out.finish_reason) == (text, "grammar_dead_end")


def _digitless_tokenizer() -> PreTrainedTokenizerFast:
    """Letters, punctuation and space only: no token can write a digit."""
    chars = sorted(set("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ{}[]\":,.-_'"))
    vocab = {"<unk>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="</s>",
                                   chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")


class _NoNodes:
    """The router must refuse before generating: any request reaching a node fails the test."""
    model_name = "digitless"
    calls = 0

    def generate(self, *args, **kwargs):
        type(self).calls += 1
        raise AssertionError("an unsatisfiable constraint reached the backend")

    async def abort(self, request_id: str) -> None:
        pass

    async def health(self) -> dict:
        return {"healthy": True}


@pytest.fixture(scope="module")
def digitless_router():
    tokenizer = _digitless_tokenizer()
    app = create_app(_NoNodes(), tokenizer, "digitless", 256)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
    server.should_exit = True
    thread.join(timeout=5)


@pytest.mark.parametrize("extra", [{"structured_outputs": {"regex": "[0-9]+"}},
                                   {"response_format": {"type": "json_schema", "json_schema": {
                                       "name": "n", "schema": {"enum": [1, 2]}}}},
                                   {"guided_choice": ["42", "7"]}])
def test_unsatisfiable_constraint_is_a_400(digitless_router, extra):
    client = digitless_router
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="digitless", prompt="abc", max_tokens=4, extra_body=extra)
    assert "cannot be satisfied with this model's vocabulary" in info.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="digitless", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, extra_body=extra)
    assert _NoNodes.calls == 0
