"""A MoE model's pure-decode steps on the CPU run torch with one thread, so the compiled expert
and attention kernels' workers get the cores (model_runner._cpu_decode_torch_threads); prompt
steps, and every step of a dense model, keep torch's thread count, which is restored after."""
from __future__ import annotations

import pytest
import torch
from family_models import make_family_model
from model_factory import make_model

from pdserve import LLM, SamplingParams


def _threads_per_step(path) -> list[tuple[int, int]]:
    """(tokens in the step, torch threads during its forward) for each step of a short run."""
    llm = LLM(model=str(path), num_kv_blocks=64)
    model = llm.engine.runner.model
    seen: list[tuple[int, int]] = []
    forward = model.forward

    def recording_forward(token_ids, *args, **kwargs):
        seen.append((token_ids.shape[0], torch.get_num_threads()))
        return forward(token_ids, *args, **kwargs)

    model.forward = recording_forward
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [3, 4, 5]}], params,
                 use_tqdm=False)
    return seen


@pytest.fixture
def two_torch_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_moe_decode_steps_use_one_torch_thread(tmp_path, two_torch_threads):
    pytest.importorskip("numba")
    steps = _threads_per_step(make_family_model(tmp_path, "qwen3_moe"))
    prompt_steps = [threads for tokens, threads in steps if tokens > 2]
    decode_steps = [threads for tokens, threads in steps if tokens == 2]
    assert prompt_steps and decode_steps
    assert set(prompt_steps) == {2} and set(decode_steps) == {1}
    assert torch.get_num_threads() == 2


def test_dense_decode_steps_keep_torch_threads(tmp_path, two_torch_threads):
    steps = _threads_per_step(make_model(tmp_path, "llama"))
    assert {threads for _, threads in steps} == {2}
