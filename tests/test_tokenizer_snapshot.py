"""A node decodes with its tokenizer's snapshot (pdserve.models.tokenizer_snapshot), never importing
transformers: its text, EOS id, length and added tokens are transformers' own, streamed or whole,
on every tokenizer family the tests build; a tokenizer whose decode transformers changes is not
snapshotted, and a node engine then loads transformers' class as before."""
from __future__ import annotations

import random
import subprocess
import sys
from types import SimpleNamespace

import pytest
from test_detokenize import TOKENIZERS
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pdserve.engine.output_processor import OutputProcessor
from pdserve.models.builtin import ensure_builtin_model
from pdserve.models.gguf import DEFAULT_MODEL
from pdserve.models.model_path import load_decode_tokenizer, load_tokenizer, resolve_model_path
from pdserve.models.tokenizer_snapshot import SnapshotTokenizer, load_snapshot, save_snapshot, snapshot_file
from pdserve.protocol.sampling_params import SamplingParams


def _saved(root, kind: str):
    path = root / kind
    TOKENIZERS[kind]().save_pretrained(path)
    (path / "config.json").write_text('{"model_type": "llama"}')
    return path


@pytest.fixture(scope="module")
def default_model():
    """The default model's GGUF view (its tokenizer written by transformers), in the user's cache,
    where the clusters that serve it made it: writing it into a private cache takes a minute."""
    try:
        return resolve_model_path(DEFAULT_MODEL)
    except (ValueError, OSError, ImportError):
        return None


def _checkpoints(root, default_model) -> list:
    paths = [_saved(root, kind) for kind in sorted(TOKENIZERS)] + [ensure_builtin_model("builtin:tiny")]
    return paths + ([default_model] if default_model is not None else [])


def _streamed(processor: OutputProcessor, ids: list[int], params: SamplingParams) -> str:
    req = SimpleNamespace(request_id="r", sampling_params=params, output_token_ids=[])
    processor.add("r", params, [])
    text = ""
    for n, token in enumerate(ids, start=1):
        req.output_token_ids.append(token)
        text += processor.new_text(req, finished=n == len(ids))[0]
    processor.remove("r")
    return text


def test_a_snapshot_decodes_as_transformers_does(default_model, tmp_path, private_cache):
    for path in _checkpoints(tmp_path, default_model):
        full = load_tokenizer(path)  # writes the snapshot
        light = load_decode_tokenizer(path)
        assert isinstance(light, SnapshotTokenizer), path
        assert (len(light), light.eos_token_id) == (len(full), full.eos_token_id), path
        assert {i: (t.content, t.special) for i, t in light.added_tokens_decoder.items()} == \
            {i: (t.content, t.special) for i, t in full.added_tokens_decoder.items()}, path
        specials = sorted(full.all_special_ids)
        rng = random.Random(str(path))
        for skip in (True, False):
            params = SamplingParams(max_tokens=100, skip_special_tokens=skip)
            processor = OutputProcessor(light, eos_token_ids=set(), max_model_len=10_000)
            for _ in range(60):
                ids = [rng.choice(specials) if rng.random() < 0.25 else rng.randrange(len(full))
                       for _ in range(rng.randrange(1, 40))]
                expected = full.decode(ids, skip_special_tokens=skip)
                assert light.decode(ids, skip_special_tokens=skip) == expected, (path, ids)
                assert _streamed(processor, ids, params) == expected, (path, ids)


def _wordpiece(path) -> None:
    """A WordPiece tokenizer whose text transformers cleans up ("a ." -> "a."), the library not."""
    words = ["[UNK]", "a", "b", "c", ".", ",", "!", "?", "'", "s"]
    core = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.decoder = decoders.WordPiece(cleanup=False)
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", eos_token="[UNK]",
                            clean_up_tokenization_spaces=True).save_pretrained(path)
    (path / "config.json").write_text('{"model_type": "bert"}')


class _ShoutingTokenizer(PreTrainedTokenizerFast):
    def _decode(self, *args, **kwargs) -> str:
        return super()._decode(*args, **kwargs).upper()


def test_a_tokenizer_whose_decode_transformers_changes_is_not_snapshotted(tmp_path, private_cache):
    _wordpiece(tmp_path / "wordpiece")
    full = load_tokenizer(tmp_path / "wordpiece")
    assert full.decode(full.encode("a . b", add_special_tokens=False)) == "a. b"  # the clean-up at work
    assert not snapshot_file(tmp_path / "wordpiece").exists()
    assert load_decode_tokenizer(tmp_path / "wordpiece").__class__ is full.__class__

    path = _saved(tmp_path, "byte-bpe")
    save_snapshot(path, _ShoutingTokenizer.from_pretrained(path))
    assert load_snapshot(path) is None


def test_a_snapshot_hands_transformers_class_to_whoever_needs_more(tmp_path, private_cache):
    path = _saved(tmp_path, "byte-bpe")
    load_tokenizer(path)
    light = load_decode_tokenizer(path)
    assert isinstance(light.full(), PreTrainedTokenizerFast) and light.full() is light.full()
    ids = light.full().encode("é a€", add_special_tokens=False)
    assert light.decode(ids, clean_up_tokenization_spaces=True) == light.full().decode(ids) == "é a€"


# A node's engine (build_engine with its role), once an earlier process loaded the tokenizer:
# transformers stays out of the process, and its greedy text is the offline engine's.
NODE_ENGINE = """
import sys
from pdserve.assembly.build import build_engine
from pdserve.engine.config import EngineConfig
from pdserve.protocol.sampling_params import SamplingParams
engine = build_engine(EngineConfig(model="builtin:tiny", kv_cache_memory_gb=0.1), role=sys.argv[1])
engine.add_request("r", [5, 9, 40, 77, 3], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, skip_special_tokens=False))
text = ""
while engine.has_unfinished_requests():
    text += "".join(o.new_text for o in engine.step())
print(type(engine.tokenizer).__name__, "transformers" in sys.modules, ascii(text), sep="\\n")
"""


@pytest.fixture(scope="module")
def offline_text() -> str:
    from pdserve import LLM
    llm = LLM("builtin:tiny", kv_cache_memory_gb=0.1)  # loads the tokenizer: writes the snapshot
    return llm.generate([{"prompt_token_ids": [5, 9, 40, 77, 3]}],
                        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, skip_special_tokens=False),
                        use_tqdm=False)[0].outputs[0].text


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_node_engine_decodes_without_transformers(role, offline_text):
    out = subprocess.run([sys.executable, "-c", NODE_ENGINE, role], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["SnapshotTokenizer", "False", ascii(offline_text)], out.stdout


# A node loads transformers' tokenizer on a thread as it starts (node.main); a structured-output
# request that comes meanwhile must wait for that load before xgrammar imports transformers'
# classes: both imports at once failed a soak's first regex request on a restarted node.
GRAMMAR_WHILE_LOADING = """
import importlib.abc, re, sys, time
from pdserve.assembly.build import build_engine
from pdserve.engine.config import EngineConfig
from pdserve.node.main import _load_full_tokenizer_beside
from pdserve.protocol.sampling_params import SamplingParams, StructuredSpec
engine = build_engine(EngineConfig(model="builtin:tiny", kv_cache_memory_gb=0.1), role="prefill")
tokenizer, load = engine.tokenizer, engine.tokenizer._load_full
tokenizer._load_full = lambda path: (time.sleep(1.0), load(path))[1]  # a slow load, still running below
seen = []
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "xgrammar":
            seen.append(tokenizer._full is not None)
        return None
sys.meta_path.insert(0, Watch())
_load_full_tokenizer_beside(engine)
params = SamplingParams(max_tokens=6, temperature=0, structured=StructuredSpec("regex", "[a-z]{6}"))
engine.add_request("r", [5, 9, 40, 77, 3], params)
text = ""
while engine.has_unfinished_requests():
    text += "".join(o.new_text for o in engine.step())
print(seen, bool(re.fullmatch("[a-z]{6}", text)), sep="\\n")
"""


def test_a_grammar_request_waits_for_the_tokenizer_load_on_the_start_thread(offline_text):
    out = subprocess.run([sys.executable, "-c", GRAMMAR_WHILE_LOADING], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["[True]", "True"], out.stdout
