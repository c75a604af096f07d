"""A GGUF kept quantized, served by `pdserve up` 1P1D over NIXL: the official client gets the
offline engine's greedy tokens (which tests/test_gguf_quantized.py holds to transformers'), and
/metrics reports each node's weight bytes (the packed bytes, not float32's), KV bytes per token
and resident memory."""
from __future__ import annotations

import os
import re
import urllib.request

import gguf
import pytest
from openai import OpenAI
from test_gguf import write_gguf

from pdserve import LLM, SamplingParams
from pdserve.engine.footprint import weight_bytes
from pdserve.testing.private_cache import private_cache_dir
from pdserve.testing.up_cluster import running_cluster

SIZES = dict(hidden_size=256, intermediate_size=512)
PROMPTS = ["the thin tin", "a hat in the hat"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    saved = os.environ.get("PDSERVE_CACHE_DIR")
    os.environ["PDSERVE_CACHE_DIR"] = str(private_cache_dir(root))  # the nodes find the kernels built
    try:
        path = write_gguf(root / "m.Q4_1.gguf", "llama", gguf.GGMLQuantizationType.Q4_1, dims=SIZES)
        with running_cluster("--model", str(path), "--prefill-nodes", "1", "--decode-nodes", "1",
                             "--kv-transfer", "nixl") as (url, _):
            yield path, url
    finally:
        os.environ.pop("PDSERVE_CACHE_DIR") if saved is None else os.environ.update(PDSERVE_CACHE_DIR=saved)


def test_served_tokens_match_offline_and_metrics_report_memory(served):
    path, url = served
    llm = LLM(str(path), num_kv_blocks=32)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    got = [client.completions.create(model=model, prompt=p, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]
    assert got == want
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()

    def series(name: str) -> list[float]:
        return [float(v) for v in re.findall(rf'^{name}{{node="[^"]+"}} (\S+)$', text, re.M)]

    expected = weight_bytes(llm.engine.model)
    spec = llm.engine.model.spec
    assert series("pdserve_node_weight_bytes") == [expected, expected]
    q, kv, h = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.hidden_size
    matrices = spec.vocab_size * h + spec.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * spec.intermediate_size)
    assert expected < 0.25 * 4 * matrices  # Q4_1 is 5 bits a weight: the packed bytes, not float32's
    per_token = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 4
    assert series("pdserve_node_kv_bytes_per_token") == [per_token, per_token]
    assert all(r > expected for r in series("pdserve_node_resident_memory_bytes"))
