"""Every architecture of the model families through a real `pdserve up` 1P1D cluster (router,
prefill and decode nodes as separate processes), over NIXL and over the store, driven by the
official openai client: greedy output equals transformers' `generate` in float32 on the same
random weights, and a seeded sampled request equals the offline engine's.

The architectures with a cluster test of their own (COVERED_ELSEWHERE) are not repeated here;
the coverage test fails when an architecture is added without a P/D test. The NIXL and the store
cluster of one architecture run side by side: their starts and stops overlap.

Each request's KV must arrive over the path under test: the decode node's recompute fallback
would hide a broken handover behind correct tokens, so the node's transfer counters are checked.
"""
from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

import openai
import pytest
from family_models import assert_meaningful, load_reference, make_family_model, random_prompts, reference_greedy

from pdserve import LLM, SamplingParams
from pdserve.models.loader import SUPPORTED_ARCHITECTURES
from pdserve.testing.model_factory import make_deepseek
from pdserve.testing.up_cluster import node_stats, running_clusters, wait_for

NEW_TOKENS = 10
SEEDED = dict(max_tokens=8, temperature=0.8, top_p=0.9, seed=11)
# kind -> (architecture, checkpoint builder, weight seed: one whose greedy steps have no near tie)
KINDS = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", make_family_model, 0),
    "qwen2_moe": ("Qwen2MoeForCausalLM", make_family_model, 0),
    "mixtral": ("MixtralForCausalLM", make_family_model, 0),
    "gemma3_text": ("Gemma3ForCausalLM", make_family_model, 3),
    "deepseek_v2": ("DeepseekV2ForCausalLM", make_deepseek, 0),
}
# architecture -> the test module that runs it through `pdserve up` on both transfers
COVERED_ELSEWHERE = {
    "GptOssForCausalLM": "test_models_sliding.py",
    "DeepseekV3ForCausalLM": "test_mla_cluster.py",
    "LlamaForCausalLM": "test_cluster.py",  # builtin:tiny
    "MistralForCausalLM": "test_sliding_free.py",  # every layer sliding: only the window moves
    # Qwen2 and Qwen3 run llama.py's decoder over the Llama KV layout (with full layers): what
    # P/D moves and how it is read do not differ from Llama's, so test_cluster.py stands for them.
    "Qwen2ForCausalLM": "test_cluster.py",
    "Qwen3ForCausalLM": "test_cluster.py",
    # vision-language models: their images cross P/D with the prompt
    "Qwen2_5_VLForConditionalGeneration": "test_vlm_cluster.py",
    "Gemma3ForConditionalGeneration": "test_vlm_epd_cluster.py",
    "Qwen3_5ForConditionalGeneration": "test_qwen3_5_vl_cluster.py",  # images and recurrent state
    # hybrid models: the recurrent state crosses with the blocks. Qwen3.5 (Gated DeltaNet) over
    # NIXL, Nemotron-H (Mamba2) through the store; Qwen3-Next keeps Qwen3.5's state and Granite
    # 4.0-H Nemotron-H's (models/gated_deltanet.py, models/mamba2_mixer.py): what P/D moves
    # and how it is read do not differ.
    "Qwen3_5ForCausalLM": "test_hybrid_pd.py",
    "Qwen3NextForCausalLM": "test_hybrid_pd.py",
    "NemotronHForCausalLM": "test_hybrid_pd.py",
    "GraniteMoeHybridForCausalLM": "test_hybrid_pd.py",
    "FalconH1ForCausalLM": "test_hybrid_pd.py",
}


def test_every_supported_architecture_has_a_pd_test():
    covered = {arch for arch, _, _ in KINDS.values()} | set(COVERED_ELSEWHERE)
    assert covered == set(SUPPORTED_ARCHITECTURES)
    for module in set(COVERED_ELSEWHERE.values()):
        assert "running_cluster" in (Path(__file__).parent / module).read_text(), module


@pytest.fixture(scope="module", params=list(KINDS))
def expected(request, tmp_path_factory):
    """The checkpoint, its prompts, transformers' greedy tokens and the offline seeded tokens.
    Prompts: a shared 37-token prefix (past a block, Gemma's 21-token window) with two tails,
    so the second request's prefix comes from the prefill node's cache, and a short one."""
    kind = request.param
    _, build, seed = KINDS[kind]
    path = build(tmp_path_factory.mktemp("pd"), kind, seed=seed)
    ref = load_reference(path)
    vocab = ref.config.vocab_size
    base = random_prompts(7, vocab, [37])[0]
    prompts = [base + tail for tail in random_prompts(8, vocab, [4, 13])] + random_prompts(9, vocab, [20])
    greedy = []
    for prompt in prompts:
        tokens, gaps = reference_greedy(ref, prompt, NEW_TOKENS)
        assert_meaningful(tokens, gaps)
        greedy.append(tokens)
    offline = LLM(model=str(path), num_kv_blocks=64)
    seeded = offline.generate([{"prompt_token_ids": prompts[1]}], SamplingParams(**SEEDED, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids
    assert seeded != greedy[1], "the sampled request should not just repeat greedy"
    return path, prompts, greedy, seeded


def _complete(client: openai.OpenAI, model: str, prompt: list[int], **params) -> list[int]:
    r = client.completions.create(model=model, prompt=prompt, **{"max_tokens": NEW_TOKENS, "temperature": 0, **params},
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    return r.choices[0].model_extra["token_ids"]


# The store: LMCache in front of Redis. 32-token chunks, so a 41-token prompt moves as one
# LMCache chunk and a partial tail through direct Redis: both halves of the store see the layout.
TRANSFERS = {"nixl": ("--kv-transfer", "nixl"),
             "store": ("--kv-transfer", "store", "--store-chunk-tokens", "32")}


def test_pd_greedy_matches_transformers_and_seeded_matches_offline(expected):
    path, prompts, greedy, seeded = expected
    model = str(path)
    flag_sets = [("--model", model, *flags, "--num-kv-blocks", "64") for flags in TRANSFERS.values()]
    with running_clusters(*flag_sets) as clusters:
        for transfer, (url, _) in zip(TRANSFERS, clusters):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
            got = [_complete(client, model, prompts[0])]  # first alone: the others reuse its prefix
            with cf.ThreadPoolExecutor(len(prompts)) as pool:  # then batched on the decode node
                got += pool.map(lambda p: _complete(client, model, p), prompts[1:])
            assert got == greedy, f"{path.name} over {transfer}: greedy differs from transformers"
            assert _complete(client, model, prompts[1], **SEEDED) == seeded, \
                f"{path.name} over {transfer}: seeded sampling differs from the offline engine"
            _assert_moved_over(url, transfer, requests=len(prompts) + 1)


def _assert_moved_over(url: str, transfer: str, requests: int) -> None:
    """Every request's KV reached the decode node over `transfer`, none recomputed, and every
    block went back to the pools."""
    decode = wait_for(lambda: _decode_stats_after(url, pulls=requests))
    assert decode["transfers_failed"] == 0, f"{transfer}: {decode['transfers_failed']} pulls failed and were recomputed"
    assert decode[f"transfer_bytes_{transfer}"] > 0
    assert decode[f"transfer_bytes_{'store' if transfer == 'nixl' else 'nixl'}"] == 0
    wait_for(lambda: all(n["free_blocks"] == n["total_blocks"] for n in node_stats(url).values()))


def _decode_stats_after(url: str, pulls: int) -> dict | None:
    """The decode node's stats once it has finished `pulls` pulls (stats ride the health pings)."""
    stats = node_stats(url)["decode-0"]
    return stats if stats["transfers_ok"] + stats["transfers_failed"] >= pulls else None
