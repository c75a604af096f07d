"""Qwen3-MoE, Qwen2-MoE (shared expert, a dense layer) and Mixtral in pdserve's offline engine
against transformers' forward and generate on the same random weights, in float32."""
from __future__ import annotations

import pytest
from family_models import check_offline_greedy, check_prompt_logits, load_reference, make_family_model

from pdserve.models.loader import ModelLoadError, load_hf_config


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe", "mixtral"])
def checkpoint(request, tmp_path_factory):
    path = make_family_model(tmp_path_factory.mktemp("moe"), request.param)
    return path, load_reference(path)


def test_prompt_logits_match(checkpoint):
    check_prompt_logits(*checkpoint)


def test_greedy_batched_chunked_cached_and_preempted_match_generate(checkpoint):
    check_offline_greedy(*checkpoint)


def test_unsupported_config_is_refused(tmp_path):
    path = make_family_model(tmp_path, "qwen3_moe", hidden_act="gelu")
    with pytest.raises(ModelLoadError, match="hidden_act"):
        load_hf_config(path)
