"""CUDA-graph decode against eager decode and transformers' greedy generate. Needs a CUDA GPU
(skipped elsewhere): graphs only exist there. Batches of 1, 3, 5 and 19 requests hit exact
buckets and padded ones (19 pads to 32), and requests finishing at different steps make later
steps' batches shrink through the buckets."""
from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from pdserve.testing.model_factory import make_model
    return make_model(tmp_path_factory.mktemp("graphs"), "llama")


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(3, 70))] for _ in range(n)]


def _generate(path, prompts, max_tokens, eager: bool, dtype: str = "float32"):
    from pdserve import LLM, SamplingParams
    llm = LLM(model=str(path), dtype=dtype, device="cuda", kernel_backend="triton",
              num_kv_blocks=512, max_num_seqs=32, enforce_eager=eager)
    assert (llm.engine.runner.graphs is None) == eager
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("batch", [1, 3, 5, 19])
def test_graph_decode_matches_transformers_and_eager(model_path, batch):
    from pdserve.testing.model_factory import load_reference
    prompts = _prompts(batch, seed=batch)
    max_tokens = [8 + (i * 5) % 17 for i in range(batch)]  # requests leave at different steps
    graphs = _generate(model_path, prompts, max_tokens, eager=False)
    eager = _generate(model_path, prompts, max_tokens, eager=True)
    assert graphs == eager
    ref = load_reference(model_path).cuda()
    for p, m, got in zip(prompts, max_tokens, graphs):
        ids = torch.tensor([p], device="cuda")
        want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=m,
                            do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert got == want


def test_graph_logits_match_eager_logits(model_path):
    """One decode step's logits, replayed graph against the eager forward, same inputs."""
    from pdserve import LLM, SamplingParams
    llm = LLM(model=str(model_path), dtype="float32", device="cuda", kernel_backend="triton",
              num_kv_blocks=512, max_num_seqs=32)
    engine = llm.engine
    for i, p in enumerate(_prompts(11, seed=3)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.step()  # prefill everything
    items = [(r, 1) for r in engine.scheduler.running]
    assert len(items) == 11
    graph_logits, _ = engine.runner.execute(items)
    graphs, engine.runner.graphs = engine.runner.graphs, None
    eager_logits, _ = engine.runner.execute(items)
    engine.runner.graphs = graphs
    torch.testing.assert_close(graph_logits, eager_logits, rtol=1e-4, atol=1e-4)
