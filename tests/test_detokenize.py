"""Streamed text adds up to exactly what Hugging Face's decode gives for the same ids.

Three tokenizer families, each with special tokens mid-text: WordLevel (words joined by
spaces, where a window decode loses the space after a skipped special token), byte-level BPE
(multi-byte characters split across tokens, invalid UTF-8 tails) and SentencePiece-style
Metaspace. Reference: `tokenizer.decode(ids, skip_special_tokens=...)`. End to end, a
random-weight model made to emit special tokens is served through real processes and read
with the official openai client, streamed and not.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import openai
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pdserve import LLM, SamplingParams
from pdserve.engine.output_processor import OutputProcessor
from pdserve.models.builtin import build_byte_tokenizer

SPECIALS = ["<s>", "</s>", "<unk>", "<sep>"]


def _fast(core: Tokenizer) -> PreTrainedTokenizerFast:
    core.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", sep_token="<sep>")


def wordlevel_tokenizer() -> PreTrainedTokenizerFast:
    core = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(300)} | {"<unk>": 300}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return _fast(core)


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    pieces = ["▁", "▁the", "▁cat", "s", "▁é", "t", "é", "▁sat", "on", "▁mat", "x", "▁x"] + [f"▁p{i}" for i in range(40)]
    core = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)} | {"<unk>": len(pieces)}, merges=[],
                                unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace()
    core.decoder = decoders.Metaspace()
    return _fast(core)


TOKENIZERS = {"wordlevel": wordlevel_tokenizer, "byte-bpe": build_byte_tokenizer, "metaspace": metaspace_tokenizer}


def _random_ids(tok, rng: random.Random) -> list[int]:
    specials = [i for i in tok.all_special_ids if i != tok.eos_token_id]
    return [rng.choice(specials) if rng.random() < 0.25 else rng.randrange(len(tok) - len(SPECIALS))
            for _ in range(rng.randrange(1, 40))]


def _stream_text(processor: OutputProcessor, ids: list[int], params: SamplingParams, primed: int = 0,
                 with_primed: bool = True) -> str:
    """The deltas a node sends for ids, after `primed` tokens whose text another node sent
    (prepended, as the replay says it was sent, when with_primed)."""
    req = SimpleNamespace(request_id="r", sampling_params=params, output_token_ids=list(ids[:primed]))
    processor.add("r", params, list(ids[:primed]))
    state = processor.states["r"]
    text = state.text[:state.emitted] if with_primed else ""
    for n, token in enumerate(ids[primed:], start=primed + 1):
        req.output_token_ids.append(token)
        chunk, stopped = processor.new_text(req, finished=n == len(ids))
        text += chunk
        if stopped:
            break
    processor.remove("r")
    return text


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
@pytest.mark.parametrize("skip", [True, False])
def test_streamed_deltas_equal_hf_decode(kind, skip):
    tok = TOKENIZERS[kind]()
    processor = OutputProcessor(tok, eos_token_ids={tok.eos_token_id}, max_model_len=10_000)
    rng = random.Random(f"{kind}-{skip}")
    params = SamplingParams(max_tokens=100, skip_special_tokens=skip)
    for _ in range(200):
        ids = _random_ids(tok, rng)
        expected = tok.decode(ids, skip_special_tokens=skip)
        assert _stream_text(processor, ids, params) == expected, ids
        # Handed over after the first token (P/D): the decode node primes with it.
        if len(ids) > 1:
            assert _stream_text(processor, ids, params, primed=1) == expected, ids


def test_eos_is_hidden_and_a_held_utf8_tail_is_flushed():
    tok = build_byte_tokenizer()
    processor = OutputProcessor(tok, eos_token_ids={tok.eos_token_id}, max_model_len=10_000)
    euro = tok.convert_tokens_to_ids(list(tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("€")[0][0]))
    ids = [tok.convert_tokens_to_ids("a"), *euro[:2], tok.eos_token_id]  # "a" + 2 of the 3 bytes of "€", EOS
    text = _stream_text(processor, ids, SamplingParams(max_tokens=100, skip_special_tokens=False))
    assert text == tok.decode(ids[:-1]) and text.startswith("a") and text.endswith("\ufffd")


@pytest.mark.parametrize("stream", [True, False])
def test_served_text_with_special_tokens_equals_hf_decode(stream, plain_cluster):
    """Seeded sampling at the highest temperature OpenAI allows (2) makes the built-in model emit
    special tokens; the served text (P/D over NIXL, conftest's shared cluster) must be HF's decode
    of the offline engine's ids."""
    llm = LLM("builtin:tiny")
    tok = llm.engine.tokenizer
    special = set(tok.all_special_ids) - {tok.eos_token_id}
    prompts = [[(17 * i + k) % 250 + 3 for i in range(24)] for k in range(12)]
    params = dict(max_tokens=48, temperature=2.0, seed=11)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(ignore_eos=True, **params),
                        use_tqdm=False)
    ids = [o.outputs[0].token_ids for o in outs]
    assert sum(t in special for seq in ids for t in seq) >= 3, "the model must emit special tokens"
    client = openai.OpenAI(base_url=f"{plain_cluster}/v1", api_key="unused", max_retries=0)
    for prompt, expected_ids in zip(prompts, ids):
        kw = dict(model="builtin:tiny", prompt=prompt, extra_body={"ignore_eos": True}, **params)
        if stream:
            text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
        else:
            text = client.completions.create(**kw).choices[0].text
        assert text == tok.decode(expected_ids, skip_special_tokens=True)


def _handover_text(processor: OutputProcessor, ids: list[int], params: SamplingParams) -> str:
    """What the client gets when a prefill node draws ids[0] and a decode node the rest."""
    req = SimpleNamespace(request_id="p", sampling_params=params, output_token_ids=[ids[0]])
    processor.add("p", params, continues_elsewhere=True)
    first, stopped = processor.new_text(req, finished=True)  # max_tokens=1 ends it there
    processor.remove("p")
    return first if stopped else first + _stream_text(processor, ids, params, primed=1, with_primed=False)


def test_handover_keeps_held_back_text_and_stop_strings():
    """The prefill node holds back a possible stop-string prefix or a partial UTF-8 character
    after its one token; the decode node replays that token to know what the client has."""
    tok = build_byte_tokenizer()
    processor = OutputProcessor(tok, eos_token_ids={tok.eos_token_id}, max_model_len=10_000)
    rng = random.Random(5)
    alphabet = "ab€é "
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(2, 12)))
        ids = tok.encode(text, add_special_tokens=False)
        stop = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 3)))]
        params = SamplingParams(max_tokens=100, stop=stop, include_stop_str_in_output=rng.random() < 0.5)
        assert _handover_text(processor, ids, params) == _stream_text(processor, ids, params), (text, stop)
        plain = SamplingParams(max_tokens=100)
        assert _handover_text(processor, ids, plain) == tok.decode(ids) == text
