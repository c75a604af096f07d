"""The router and the nodes load the tokenizer class transformers' AutoTokenizer loads, without
importing torch, on checkpoints whose tokenizer_config.json names the generic class while
config.json names a model type with a class of its own (qwen2, llama, gemma3): the same class,
token ids and text as AutoTokenizer's. A Metaspace tokenizer under model_type qwen2 is the case
where the two differ (AutoTokenizer loads Qwen2Tokenizer, which rebuilds its own pipeline)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pdserve.models.model_path import load_tokenizer

CORPUS = ["hello world, this is a tiny corpus for a tiny tokenizer.",
          "the quick brown fox jumps over the lazy dog."] * 20
TEXT = "hello world, the quick brown fox"


def _checkpoint(root, pipeline: str, model_type: str):
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if pipeline == "metaspace":  # SentencePiece-style: spaces as "▁"
        tok.pre_tokenizer, tok.decoder, alphabet = pre_tokenizers.Metaspace(), decoders.Metaspace(), []
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder, alphabet = decoders.ByteLevel(), pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<|endoftext|>"],
                                                        initial_alphabet=alphabet))
    path = root / f"{pipeline}-{model_type}"
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<unk>").save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": ["LlamaForCausalLM"]}))
    assert json.loads((path / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    return path


@pytest.mark.parametrize("pipeline", ["metaspace", "bytelevel"])
@pytest.mark.parametrize("model_type", ["qwen2", "llama", "gemma3"])
def test_the_tokenizer_is_autotokenizers(tmp_path, pipeline, model_type):
    path = _checkpoint(tmp_path, pipeline, model_type)
    ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    assert type(ours).__name__ == type(theirs).__name__
    ids = theirs.encode(TEXT, add_special_tokens=False)
    assert ours.encode(TEXT, add_special_tokens=False) == ids
    generic = PreTrainedTokenizerFast.from_pretrained(str(path))
    generic_ids = generic.encode(TEXT, add_special_tokens=False)
    for some in (ids, generic_ids):
        assert ours.decode(some) == theirs.decode(some)
    if (pipeline, model_type) == ("metaspace", "qwen2"):  # where the generic class differs
        assert type(theirs).__name__ == "Qwen2Tokenizer"
        assert generic.decode(generic_ids) == TEXT != theirs.decode(generic_ids)


def test_loading_the_model_types_class_imports_no_torch(tmp_path):
    path = _checkpoint(tmp_path, "metaspace", "qwen2")
    code = ("import sys; from pathlib import Path; from pdserve.models.model_path import load_tokenizer; "
            f"t = load_tokenizer(Path({str(path)!r})); print(type(t).__name__, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["Qwen2Tokenizer", "False"], out.stderr[-2000:]
