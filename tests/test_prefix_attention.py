"""The torch (and numba, which delegates) prefill path that attends a cached prefix unmasked and
the new tokens causally, merged by their log-sum-exps, against a float64 reference and against
the masked path it replaces: several sequences packed in one call, with and without a cached
prefix, GQA/MQA/MHA, attention sinks, and windows both wider than the context (this path) and
narrower (the masked path)."""
from __future__ import annotations

import pytest
import torch
from test_kernels import DEVICE, assert_close, prefill_inputs
from test_models_sliding_kernels import reference

from pdserve.kernels import get_ops, torch_ops

CASES = {
    # heads, kv_heads, head_dim, block_size, (context length, new tokens) per sequence
    "gqa-mixed": (8, 2, 16, 4, [(37, 5), (9, 9), (20, 1), (64, 17)]),
    "mqa-odd-dim": (6, 1, 24, 4, [(4, 4), (33, 12)]),
    "mha-long-prefix": (4, 4, 32, 8, [(130, 3), (7, 2)]),
}


def make_inputs(case, dtype, seed):
    """The case's sequences in a shuffled paged cache, and their new tokens' q/k/v packed."""
    gen = torch.Generator().manual_seed(seed)
    x = prefill_inputs(CASES[case], 64, dtype, gen)
    x["sinks"] = 2 * torch.randn(CASES[case][0], generator=gen).to(DEVICE)
    return x


def run_case(case, dtype, window=0, with_sinks=False, backend="torch", seed=3):
    """(output, float64 reference, the masked path's output) for one case."""
    x = make_inputs(case, dtype, seed)
    q, k_new, v_new, cu, ctx_lens = x["q"], x["k_new"], x["v_new"], x["cu"], x["ctx_lens"]
    sinks = x["sinks"] if with_sinks else None
    scale = 0.3
    out = get_ops(backend).prefill_attention(
        q, k_new, v_new, x["k_cache"], x["v_cache"], torch.tensor(cu, dtype=torch.int32, device=DEVICE),
        torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE), x["tables"], scale, window=window,
        sinks=sinks)
    rows = [slice(cu[i], cu[i + 1]) for i in range(len(ctx_lens))]
    ref = torch.cat([reference(q[r], x["ks"][i], x["vs"][i], scale, window, sinks) for i, r in enumerate(rows)])
    masked = torch.cat([torch_ops._masked_prefill(q[r], k_new[r], v_new[r], x["k_cache"], x["v_cache"],
                                                  x["tables"][i], ctx_lens[i], scale, window, sinks)
                        for i, r in enumerate(rows)])
    return out, ref, masked


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_prefix_then_causal_matches_reference_and_masked_path(backend, case, with_sinks, dtype):
    out, ref, masked = run_case(case, dtype, with_sinks=with_sinks, backend=backend)
    assert out.shape == masked.shape
    assert_close(out, ref, dtype)
    if dtype == torch.float32:  # the path it replaces, to float32 rounding
        torch.testing.assert_close(out, masked, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("window", [3, 6, 200])
@pytest.mark.parametrize("case", CASES)
def test_windows_narrow_and_wide(case, window, with_sinks):
    """A window narrower than a context takes the masked path, one at least as wide as every
    context hides nothing and takes the prefix + causal path; both against the reference."""
    out, ref, masked = run_case(case, torch.float32, window=window, with_sinks=with_sinks)
    assert_close(out, ref, torch.float32)
    torch.testing.assert_close(out, masked, atol=2e-6, rtol=2e-6)


def test_cached_prefix_takes_the_unmasked_path(monkeypatch):
    """No window: a sequence with a cached prefix goes through _prefix_then_causal, which never
    builds a mask (a silent fallback to the masked path would cost the warm step its speed-up)."""
    calls = []
    real = torch_ops._prefix_then_causal
    monkeypatch.setattr(torch_ops, "_prefix_then_causal", lambda *a: calls.append(a[6]) or real(*a))
    monkeypatch.setattr(torch_ops, "_masked_prefill", lambda *a: pytest.fail("masked path taken"))
    if DEVICE != "cpu":
        pytest.skip("the prefix + causal path runs the CPU flash kernel")
    x = make_inputs("gqa-mixed", torch.float32, seed=5)
    torch_ops.prefill_attention(x["q"], x["k_new"], x["v_new"], x["k_cache"], x["v_cache"],
                                torch.tensor(x["cu"], dtype=torch.int32),
                                torch.tensor(x["ctx_lens"], dtype=torch.int32), x["tables"], 0.3)
    # The prefixes of (37, 5), (20, 1) and (64, 17); the (9, 9) sequence has none and no sinks:
    # plain causal SDPA, as before.
    assert calls == [32, 19, 47]
