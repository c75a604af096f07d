"""The feature matrix (docs/feature-matrix.md), tried cell by cell and written from the results.

Each cell runs its two features together in one engine (a P/D cell: a prefill engine hands the
prompt's KV blocks to a decode engine in this process, as NIXL or the store would, byte for
byte) on tiny random-weight checkpoints, and compares what its row measures (greedy tokens,
tokens under a grammar, prompt logprobs, embeddings) with a reference: the one-process engine
with only the features that change the output (the LoRA adapter, the FP8 cache). That reference
itself is checked here against transformers (no adapter) and PEFT (the adapter). The quantized
checkpoint is W8A16 and the float checkpoint every reference runs is its exact dequantization,
so quantization changes no token. A cell that does not run must be refused at start with a
ValueError; its message goes in the table as a ✗.

The test fails when docs/feature-matrix.md differs from the table it builds; regenerate it with
PDSERVE_WRITE_MATRIX=1 .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_feature_matrix.py
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from hybrid_refusals import hybrid_section
from lora_util import make_adapter, peft_greedy
from test_compressed_tensors import write_checkpoint

from pdserve import LLM, LoRARequest, SamplingParams
from pdserve.engine.embedding import EmbeddingBatch
from pdserve.protocol.sampling_params import StructuredSpec

DOC = Path(__file__).resolve().parent.parent / "docs" / "feature-matrix.md"
NEW_TOKENS = 8
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
COLUMNS = ["TP 2", "PP 2", "P/D handover", "quantized", "FP8 KV", "LoRA", "speculation"]
ROWS = ["LoRA", "speculation", "FP8 KV", "quantized", "structured outputs", "prompt logprobs", "embeddings"]
# Pairs with nothing to combine: embeddings run no decode step and name no adapter.
NOT_APPLICABLE = {("embeddings", "speculation"), ("embeddings", "LoRA")}
OUTPUT_CHANGING = ("LoRA", "FP8 KV")  # the reference keeps these; the others must not change a token


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("matrix")
    quantized = write_checkpoint(root, 8, None, True)
    base = _dequantized_copy(quantized, root / "float")
    adapter = make_adapter(base, root / "adapter", seed=1, r=8, alpha=16)
    rng = random.Random(0)
    prompts = []
    for n in (6, 17):
        p = [rng.randrange(3, 200) for _ in range(n)]
        prompts.append(p + p[: n // 2])  # repeats give the n-gram lookup matches
    return dict(base=base, quantized=quantized, adapter=adapter, prompts=prompts,
                transformers=peft_greedy(base, None, prompts, NEW_TOKENS),
                peft=peft_greedy(base, adapter, prompts, NEW_TOKENS), references={}, cells={}, engines=Engines())


def _dequantized_copy(quantized: Path, out: Path) -> Path:
    """A float32 checkpoint of the W8A16 one's dequantized weights (transformers decompresses)."""
    from transformers import AutoConfig, AutoModelForCausalLM, CompressedTensorsConfig
    model = AutoModelForCausalLM.from_pretrained(
        quantized, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False))
    config = AutoConfig.from_pretrained(quantized)
    del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v for k, v in model.state_dict().items() if k in plain.state_dict()}
    plain.load_state_dict(state)
    plain.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (quantized / name).is_file():
            (out / name).write_bytes((quantized / name).read_bytes())
    return out


def engine_kwargs(world, features) -> dict:
    kw = dict(model=str(world["quantized"] if "quantized" in features else world["base"]), num_kv_blocks=64,
              block_size=8)
    if "TP 2" in features:
        kw["tensor_parallel_size"] = 2
    if "PP 2" in features:
        kw["pipeline_parallel_size"] = 2
    if "FP8 KV" in features:
        kw["kv_cache_dtype"] = "fp8"
    if "LoRA" in features:
        kw.update(lora_modules={"a": str(world["adapter"])}, max_loras=1, max_lora_rank=8)
    if "speculation" in features:
        kw["speculative_config"] = NGRAM
    return kw


def row_params(row: str) -> SamplingParams:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    if row == "structured outputs":
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, structured=StructuredSpec("regex", "[a-z]{2,6}"))
    if row == "prompt logprobs":
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=1)
    return params


def measure(out, row: str):
    """What a row compares: its tokens, or its prompt logprobs."""
    if row == "prompt logprobs":
        return [None if lp is None else lp.logprob for lp in out.prompt_logprobs]
    return out.token_ids


class Engines:
    """One engine open at a time, kept while consecutive cells need the same features (the rows
    that only change the request, such as structured outputs, share their column's engine)."""

    def __init__(self):
        self.features, self.llm = None, None

    def get(self, world, features) -> LLM:
        if features != self.features:
            self.close()
            self.features = features
            self.llm = LLM(**engine_kwargs(world, features))
        return self.llm

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()
        self.features, self.llm = None, None


def run_offline(world, features, row: str) -> list:
    llm = world["engines"].get(world, features)
    prompts = world["prompts"]
    if row == "embeddings":
        batch = EmbeddingBatch(prompts, "mean")
        while not batch.done:
            assert batch.advance(llm.engine)
        return batch.vectors
    lora = LoRARequest("a", 1, str(world["adapter"])) if "LoRA" in features else None
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], row_params(row), use_tqdm=False,
                        lora_request=lora)
    assert llm.engine.pool.num_in_use() == 0
    return [measure(_first(o), row) for o in outs]


def _first(out):
    got = out.outputs[0]
    got.prompt_logprobs = out.prompt_logprobs
    return got


def run_handover(world, features, row: str) -> list:
    """A prefill engine (with the cell's features) computes each prompt and its first token,
    holding the blocks; a decode engine (at TP 1 and PP 1: a handover across degrees) takes
    the blocks' bytes as a NIXL READ would, then generates the rest."""
    decode_features = features - {"TP 2", "PP 2"}
    prefill = LLM(**engine_kwargs(world, features))
    decode = LLM(**engine_kwargs(world, decode_features))
    lora = "a" if "LoRA" in features else None
    try:
        results = []
        for i, prompt in enumerate(world["prompts"]):
            params = row_params(row)
            rid = f"h{i}"
            first = SamplingParams(**{**_fields(params), "max_tokens": 1})
            prefill.engine.add_request(rid, prompt, first, hold_blocks=True, continues_elsewhere=True, lora_name=lora)
            head = _drain(prefill.engine)[rid]
            src = prefill.engine.scheduler.held[rid].block_ids
            req = decode.engine.add_request(rid, prompt, SamplingParams(**{**_fields(params), "prompt_logprobs": None}),
                                            output_token_ids=head.new_token_ids, remote_kv_tokens=len(prompt),
                                            lora_name=lora)
            blocks = -(-len(prompt) // 8)
            decode.engine.kv_cache[req.block_ids[:blocks]] = prefill.engine.kv_cache[src[:blocks]]
            decode.engine.report_remote_kv(rid, True)
            prefill.engine.release_blocks(rid)
            tail = _drain(decode.engine)[rid]
            if row == "prompt logprobs":  # the prefill node computes them; they travel with the first token
                results.append([None if lp is None else lp.logprob for lp in head.prompt_logprobs])
            else:
                results.append(head.new_token_ids + tail.new_token_ids)
        for llm in (prefill, decode):
            assert llm.engine.pool.num_in_use() == 0
        return results
    finally:
        prefill.close()
        decode.close()


def _fields(params: SamplingParams) -> dict:
    return {k: getattr(params, k) for k in ("max_tokens", "temperature", "ignore_eos", "structured",
                                            "prompt_logprobs")}


def _drain(engine) -> dict:
    """Step until idle; each request's step outputs merged."""
    merged: dict = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id in merged:
                got = merged[out.request_id]
                got.new_token_ids += out.new_token_ids
            else:
                merged[out.request_id] = out
    return merged


REQUEST_ROWS = ("structured outputs", "prompt logprobs", "embeddings")  # a request's options, not an engine's


def cell_features(row: str, col: str) -> frozenset:
    return frozenset({row, col}) - set(REQUEST_ROWS) - {"P/D handover"}


def run_cell(world, row: str, col: str):
    features = cell_features(row, col)
    if col == "P/D handover":
        if row == "embeddings":
            return "—"
        return run_handover(world, features, row)
    return run_offline(world, features, row)


def reference(world, row: str, col: str):
    """The one-process engine with only the cell's output-changing features."""
    kept = frozenset(f for f in (row, col) if f in OUTPUT_CHANGING)
    key = (kept, row if row in REQUEST_ROWS else "tokens")
    if key not in world["references"]:
        world["references"][key] = run_offline(world, kept, key[1] if key[1] != "tokens" else "LoRA")
    return world["references"][key]


def check(world, row: str, col: str, got) -> None:
    want = reference(world, row, col)
    if row == "embeddings":
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, atol=1e-4)
    elif row == "prompt logprobs":
        for a, b in zip(got, want):
            assert [x is None for x in a] == [x is None for x in b]
            assert np.allclose([x for x in a if x is not None], [x for x in b if x is not None], atol=1e-3)
    else:
        assert got == want, f"{row} x {col}"


def cell(world, row: str, col: str) -> str:
    if row == col or (row, col) in NOT_APPLICABLE or (row == "embeddings" and col == "P/D handover"):
        return "—"
    key = (cell_features(row, col), col == "P/D handover", row if row in REQUEST_ROWS else "tokens")
    if key not in world["cells"]:  # (LoRA x FP8 KV and FP8 KV x LoRA are one cell)
        try:
            got = run_cell(world, row, col)
        except ValueError as exc:
            world["engines"].close()
            world["cells"][key] = f"✗ {str(exc).splitlines()[0]}"
        else:
            check(world, row, col, got)
            world["cells"][key] = "✓"
    return world["cells"][key]


def cell_order(row_col: tuple[str, str]):
    """Cells that need the same engine one after the other (the worker-process ones together)."""
    features = cell_features(*row_col)
    return (row_col[1] == "P/D handover", sorted(features))


def test_references_equal_transformers_and_peft(world):
    try:
        assert run_offline(world, frozenset(), "tokens") == world["transformers"]
        assert run_offline(world, frozenset({"LoRA"}), "LoRA") == world["peft"]
    finally:
        world["engines"].close()
    assert world["transformers"] != world["peft"]


def test_feature_matrix(world):
    pairs = sorted(((row, col) for row in ROWS for col in COLUMNS), key=cell_order)
    try:
        found = {pair: cell(world, *pair) for pair in pairs}
    finally:
        world["engines"].close()
    rows = [[found[(row, col)] for col in COLUMNS] for row in ROWS]
    text = render(rows)
    if os.environ.get("PDSERVE_WRITE_MATRIX") == "1":
        DOC.write_text(text)
    assert DOC.read_text() == text, ("docs/feature-matrix.md differs from the matrix this test built; regenerate it "
                                     "with PDSERVE_WRITE_MATRIX=1 .venv/bin/python -m pytest -q -p no:cacheprovider "
                                     "tests/test_feature_matrix.py")


def render(rows: list[list[str]]) -> str:
    refusals = []
    table = ["| feature | " + " | ".join(COLUMNS) + " |", "|---|" + "---|" * len(COLUMNS)]
    for row, cells in zip(ROWS, rows):
        shown = []
        for col, value in zip(COLUMNS, cells):
            if value.startswith("✗"):
                refusals.append(f"- **{row} × {col}:** {value[2:]}")
                value = "✗"
            shown.append(value)
        table.append(f"| {row} | " + " | ".join(shown) + " |")
    return (HEADER + "\n".join(table) + "\n\n" + REFUSALS + "\n".join(refusals or ["- none"]) + "\n\n"
            + hybrid_section())


HEADER = """# Feature matrix

Which features combine. `tests/test_feature_matrix.py` tries every cell and writes this page:
a cell runs its row's feature and its column's together on tiny random-weight checkpoints
(TP 2 and PP 2 with their worker processes; a P/D cell hands the prompt's KV blocks from a
prefill engine with the features to a decode engine at TP 1 and PP 1, byte for byte, as NIXL or
the store does) and compares what the row measures (greedy tokens, tokens under a regex, prompt
logprobs, mean-pooled embeddings) with the one-process engine that has only the features that
change the output (the LoRA adapter, the FP8 cache), which itself equals transformers (PEFT with
the adapter) in float32. The quantized checkpoint is compressed-tensors W8A16, compared with its
exact float32 dequantization; the other formats at TP 2 (and the ones refused there) are listed
in [tensor parallelism](tensor-parallelism.md).

✓ runs and matches; ✗ refused at start with the message below; — nothing to combine (the same
feature, or embeddings, which run no decode step and name no adapter).

Regenerate after a change:
`PDSERVE_WRITE_MATRIX=1 .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_feature_matrix.py`

"""
REFUSALS = "## Refusals\n\n"
