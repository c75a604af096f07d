"""The compiled CPU decode steps of the recurrent layers (pdserve.kernels.recurrent_cpu) against
the torch steps they replace, on a real StatePool arena: the same outputs, the named slots'
windows and states updated in place, every other slot left as it was. And the engine's decode
takes them (the family tests against transformers then cover them end to end).

Also the Mamba2 chunked scan and the gated delta rule's compiled chunked form against their
one-token recurrences, over spans cut across chunks."""
from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.state_pool import StatePool
from pdserve.kernels import causal_conv, denormals, gated_delta, mamba2, native_gemv, recurrent_cpu
from pdserve.models.state_layers import LayerStateSpec
from pdserve.testing.hybrid_checkpoints import make_hybrid_model

ROWS, SLOTS = 5, 9
HEADS, HEAD_DIM, GROUPS, SIZE = 4, 16, 2, 16  # Mamba2 (the compiled scan takes sizes in sixteens)
K_HEADS, V_HEADS, K_DIM, V_DIM = 2, 4, 16, 8  # Gated DeltaNet
CHANNELS = 40


@pytest.fixture
def pool():
    torch.manual_seed(0)
    spec = [LayerStateSpec((CHANNELS, 3), torch.float32, (HEADS, HEAD_DIM, SIZE), torch.float32),
            LayerStateSpec((CHANNELS, 3), torch.float32, (V_HEADS, K_DIM, V_DIM), torch.float32)]
    pool = StatePool(spec, SLOTS, torch.device("cpu"))
    for t in pool.conv + pool.state:
        t.copy_(torch.randn(t.shape) * 0.5)
    assert recurrent_cpu.usable(*pool.conv, *pool.state)
    return pool


SLOTS_USED = torch.tensor([7, 0, 3, 8, 2])


@pytest.fixture(params=["compiled", "numba"])
def step_kernels(request, monkeypatch):
    """The decode steps from native_recurrent.c (numba's kernels made to fail), or numba's (the
    library switched off: a build without a C compiler)."""
    if request.param == "numba":
        monkeypatch.setattr(native_gemv, "library", lambda: None)
    else:
        assert native_gemv.library() is not None
        for name in ("_gated_delta_kernel", "_mamba2_kernel", "_conv_kernel"):
            monkeypatch.setattr(recurrent_cpu, name, None)
    return request.param


def check_in_place(view: torch.Tensor, before: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.allclose(view[SLOTS_USED], want, atol=1e-5, rtol=1e-5)
    others = torch.ones(SLOTS, dtype=torch.bool)
    others[SLOTS_USED] = False
    assert torch.equal(view[others], before[others]), "a slot outside the step changed"


def test_gated_delta_step_matches_torch(pool, step_kernels):
    view, before = pool.state[1], pool.state[1].clone()
    q, k = torch.randn(ROWS, K_HEADS, K_DIM), torch.randn(ROWS, K_HEADS, K_DIM)
    v, g, beta = torch.randn(ROWS, V_HEADS, V_DIM), -torch.rand(ROWS, V_HEADS), torch.rand(ROWS, V_HEADS)
    want, want_state = gated_delta.recurrent_step(q, k, v, g, beta, view[SLOTS_USED])
    got = recurrent_cpu.gated_delta_step(q, k, v, g, beta, view, SLOTS_USED)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    check_in_place(view, before, want_state)


def test_mamba2_step_matches_torch(pool, step_kernels):
    view, before = pool.state[0], pool.state[0].clone()
    x, dt = torch.randn(ROWS, HEADS, HEAD_DIM), torch.rand(ROWS, HEADS)
    B, C = torch.randn(ROWS, GROUPS, SIZE), torch.randn(ROWS, GROUPS, SIZE)
    A, D = -torch.rand(HEADS) * 2, torch.randn(HEADS)
    want, want_state = mamba2.recurrent_step(x, dt, A, B, C, D, view[SLOTS_USED])
    got = recurrent_cpu.mamba2_step(x, dt, A, B, C, D, view, SLOTS_USED)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-5)
    check_in_place(view, before, want_state)


@pytest.mark.parametrize("bias", [False, True])
def test_conv_step_matches_torch(pool, bias, step_kernels):
    view, before = pool.conv[0], pool.conv[0].clone()
    x, weight = torch.randn(ROWS, CHANNELS), torch.randn(CHANNELS, 4)
    b = torch.randn(CHANNELS) if bias else None
    want, want_windows = causal_conv.causal_conv_step(x, view[SLOTS_USED], weight, b)
    got = recurrent_cpu.conv_step(x, view, SLOTS_USED, weight, b)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    check_in_place(view, before, want_windows)


def test_compiled_decode_steps_flush_denormals(pool):
    """native_recurrent.c's steps flush denormals (a decay e^g below 1.2e-38, or a state decayed
    there, cost a microcode assist per value): a state decayed by e^-90 with nothing added is
    exactly zero in the pool where torch's step keeps it, in both the delta rule and Mamba2."""
    assert native_gemv.library() is not None
    view = pool.state[1]
    view[SLOTS_USED] = 1.0
    zeros = torch.zeros(ROWS, V_HEADS)
    q, k, v = torch.randn(ROWS, K_HEADS, K_DIM), torch.randn(ROWS, K_HEADS, K_DIM), torch.zeros(ROWS, V_HEADS, V_DIM)
    _, want = gated_delta.recurrent_step(q, k, v, zeros - 90, zeros, view[SLOTS_USED])
    recurrent_cpu.gated_delta_step(q, k, v, zeros - 90, zeros, view, SLOTS_USED)
    assert torch.count_nonzero(want) == want.numel() and torch.count_nonzero(view[SLOTS_USED]) == 0
    view = pool.state[0]
    view[SLOTS_USED] = 1.0
    x, dt = torch.zeros(ROWS, HEADS, HEAD_DIM), torch.ones(ROWS, HEADS)
    B, C, A = torch.randn(ROWS, GROUPS, SIZE), torch.randn(ROWS, GROUPS, SIZE), torch.full((HEADS,), -90.0)
    _, want = mamba2.recurrent_step(x, dt, A, B, C, torch.zeros(HEADS), view[SLOTS_USED])
    recurrent_cpu.mamba2_step(x, dt, A, B, C, torch.zeros(HEADS), view, SLOTS_USED)
    assert torch.count_nonzero(want) == want.numel() and torch.count_nonzero(view[SLOTS_USED]) == 0


def test_other_dtypes_take_the_torch_steps():
    assert not recurrent_cpu.usable(torch.zeros(2, 3, 4, dtype=torch.bfloat16))
    assert not recurrent_cpu.usable(torch.zeros(2, 3, 4)[:, :, :2])  # a slot's part not contiguous


@pytest.mark.parametrize("length", [1, 7, 16, 45, 100])
def test_gated_delta_chunked_matches_the_recurrence(length, monkeypatch):
    """The compiled chunked form (native_delta.c, chunk 16) over spans under a chunk, exactly one
    and several with a partial last one, from a non-zero state, decays up to e^-20 a token: the
    token-by-token recurrence's outputs and final state, and the compiled kernel ran."""
    torch.manual_seed(length)
    v_dim = 32  # (the kernel takes head sizes in sixteens)
    q, k = torch.randn(length, K_HEADS, K_DIM), torch.randn(length, K_HEADS, K_DIM)
    v, g = torch.randn(length, V_HEADS, v_dim), -torch.rand(length, V_HEADS) * 20
    beta, state = torch.rand(length, V_HEADS), torch.randn(V_HEADS, K_DIM, v_dim) * 0.5
    ran = []
    compiled = gated_delta._compiled
    monkeypatch.setattr(gated_delta, "_compiled", lambda *a: ran.append(compiled(*a)) or ran[-1])
    out, final = gated_delta.chunked(q, k, v, g, beta, state, chunk=16)
    assert ran and ran[0] is not None
    current, want = state[None], []
    for t in range(length):
        one, current = gated_delta.recurrent_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1],
                                                  current)
        want.append(one)
    assert torch.allclose(out, torch.cat(want), atol=1e-5, rtol=1e-4)
    assert torch.allclose(final, current[0], atol=1e-5, rtol=1e-4)


def test_a_steps_prompt_spans_take_one_compiled_call_with_each_spans_chunked_values():
    """gated_delta.spans_compiled (every prefill span of a step in one call, from the layer's
    token-major rows, q and k strided views not yet normalised) against `chunked` span by span:
    the same outputs in each span's rows and the same states, updated in place in their slots of
    a pool view narrowed to some heads (as a tensor-parallel rank's), other slots untouched."""
    torch.manual_seed(3)
    lengths, v_dim, heads = [1, 7, 16, 45, 100], 32, 2 * V_HEADS
    total = sum(lengths) + 3  # (three decode rows first, which the call leaves alone)
    mixed = torch.randn(total, 2 * K_HEADS * K_DIM + heads * v_dim)
    q, k, v = mixed.split([K_HEADS * K_DIM, K_HEADS * K_DIM, heads * v_dim], dim=-1)
    q, k, v = q.view(total, K_HEADS, K_DIM), k.view(total, K_HEADS, K_DIM), v.reshape(total, heads, v_dim)
    g, beta = -torch.rand(total, heads) * 5, torch.rand(total, heads)
    whole = torch.randn(SLOTS, 2 * heads, K_DIM, v_dim)
    pool = whole.narrow(1, heads, heads)
    before = whole.clone()
    spans, row = [], 3
    for slot, n in zip((4, 0, 7, 2, 8), lengths):
        spans.append((slot, row, row + n))
        row += n
    want_states = {slot: gated_delta.chunked(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], pool[slot], chunk=16)
                   for slot, a, b in spans}
    out = gated_delta.spans_compiled(q, k, v, g, beta, pool, spans, chunk=16)
    assert out is not None
    for slot, a, b in spans:
        want_out, want_state = want_states[slot]
        assert torch.allclose(out[a:b], want_out, atol=1e-5, rtol=1e-4)
        assert torch.allclose(pool[slot], want_state, atol=1e-5, rtol=1e-4)
    assert torch.equal(whole[:, :heads], before[:, :heads])
    untouched = [s for s in range(SLOTS) if s not in (4, 0, 7, 2, 8)]
    assert torch.equal(whole[untouched], before[untouched])


@pytest.mark.parametrize("bias", [False, True])
def test_a_steps_prompt_spans_convolve_in_one_compiled_call_as_causal_conv(pool, bias):
    """recurrent_cpu.conv_spans (every prefill span of a step in one call) against
    causal_conv.causal_conv span by span: spans of 1 and 2 tokens (shorter than the window, which
    carries over), of exactly a window, and longer; channels that are not a multiple of the
    64-channel blocks; windows a run of the pool's channels (a tensor-parallel rank's), updated in
    place, other channels and slots untouched."""
    torch.manual_seed(5)
    whole = pool.conv[0]
    windows, before = whole.narrow(1, 3, 30), whole.clone()
    lengths, slots = [1, 2, 3, 19, 70], [6, 1, 4, 0, 8]
    total = sum(lengths) + 2
    x = torch.randn(total, 30 + 5)[:, 2:32]  # (a strided view of the layer's wider rows)
    weight, b = torch.randn(30, 4), (torch.randn(30) if bias else None)
    spans, row = [], 2
    for slot, n in zip(slots, lengths):
        spans.append((slot, row, row + n))
        row += n
    want = {slot: causal_conv.causal_conv(x[a:c], windows[slot].clone(), weight, b) for slot, a, c in spans}
    out = recurrent_cpu.conv_spans(x, windows, spans, weight, b)
    assert out is not None
    for slot, a, c in spans:
        assert torch.allclose(out[a:c], want[slot][0], atol=1e-5, rtol=1e-5)
        assert torch.equal(windows[slot], want[slot][1])
    others = torch.ones_like(whole, dtype=torch.bool)
    others[slots, 3:33] = False
    assert torch.equal(whole[others], before[others])


def test_compiled_delta_rule_flushes_denormals_inside_and_leaves_the_caller_as_it_was():
    """native_delta.c runs with denormals flushed (a strongly decaying head's e^(d_i - d_j) put
    whole blocks below 1.2e-38, each value a microcode assist): values that small read as zero
    there, so denormal values give exactly zero where torch's recurrence keeps them. The caller's
    threads get their mode back: torch's own ops after the call, on this thread and on its OpenMP
    threads, still keep denormals."""
    torch.manual_seed(0)
    length, v_dim = 40, 32
    q, k = torch.randn(length, K_HEADS, K_DIM), torch.randn(length, K_HEADS, K_DIM)
    v = torch.full((length, V_HEADS, v_dim), 1e-39)
    g, beta, state = torch.zeros(length, V_HEADS), torch.ones(length, V_HEADS), torch.zeros(V_HEADS, K_DIM, v_dim)
    out, final = gated_delta.chunked(q, k, v, g, beta, state, chunk=16)
    assert torch.count_nonzero(out) == 0 and torch.count_nonzero(final) == 0
    want, _ = gated_delta.recurrent_step(q[:1], k[:1], v[:1], g[:1], beta[:1], state[None])
    assert torch.count_nonzero(want) > 0  # (torch keeps them: what the kernel flushed)
    assert torch.tensor([1e-39]).mul(1.0).item() != 0.0
    assert bool((torch.full((1 << 20,), 1e-39) * 1.0).ne(0).all())


@pytest.fixture(params=["compiled", "torch"])
def mamba2_scan(request, monkeypatch):
    """The chunked scan from native_recurrent.c (torch's form made to fail), or torch's (the
    compiled scan declining, as it does without the library or for head sizes not in sixteens)."""
    if request.param == "torch":
        monkeypatch.setattr(mamba2, "_compiled", lambda *args: None)
    else:
        assert native_gemv.library() is not None
        monkeypatch.setattr(mamba2, "_chunked", None)
    return request.param


@pytest.mark.parametrize("length", [1, 7, 32, 45, 100])
def test_mamba2_chunked_matches_the_recurrence(length, mamba2_scan):
    """Spans shorter than a chunk, one chunk, and several with a partial last one (chunk 32),
    from a non-zero state, compiled and in torch: the chunked form gives the token-by-token
    recurrence's outputs and final state."""
    torch.manual_seed(length)
    x, dt = torch.randn(length, HEADS, HEAD_DIM), torch.rand(length, HEADS) * 0.5
    B, C = torch.randn(length, GROUPS, SIZE), torch.randn(length, GROUPS, SIZE)
    A, D, state = -torch.rand(HEADS) * 2, torch.randn(HEADS), torch.randn(HEADS, HEAD_DIM, SIZE)
    y, final = mamba2.chunked(x, dt, A, B, C, D, state, chunk=32)
    current, ys = state[None], []
    for t in range(length):
        out, current = mamba2.recurrent_step(x[t:t + 1], dt[t:t + 1], A, B[t:t + 1], C[t:t + 1], D, current)
        ys.append(out)
    assert torch.allclose(y, torch.cat(ys), atol=1e-4, rtol=1e-4)
    assert torch.allclose(final, current[0], atol=1e-4, rtol=1e-4)


def test_mamba2_chunked_flushes_denormals_on_every_thread_and_gives_the_mode_back(mamba2_scan):
    """mamba2.chunked's torch ops run with denormals flushed on this thread and torch's OpenMP
    threads (denormals.flushed: its decays across a chunk make blocks of them): denormal inputs
    read as zero, so the output is exactly zero where the unflushed recurrence keeps them, and a
    parallel op inside the block flushes too. After it every thread keeps denormals again."""
    torch.manual_seed(0)
    length = 40
    x, dt = torch.full((length, HEADS, HEAD_DIM), 1e-39), torch.rand(length, HEADS) * 0.5
    B, C = torch.randn(length, GROUPS, SIZE), torch.randn(length, GROUPS, SIZE)
    A, D, state = -torch.rand(HEADS) * 2, torch.randn(HEADS), torch.zeros(HEADS, HEAD_DIM, SIZE)
    y, _ = mamba2.chunked(x, dt, A, B, C, D, state, chunk=32)
    assert torch.count_nonzero(y) == 0
    want, _ = mamba2.recurrent_step(x[:1], dt[:1], A, B[:1], C[:1], D, state[None])
    assert torch.count_nonzero(want) > 0
    many = torch.full((1 << 20,), 1e-39)
    with denormals.flushed():
        assert torch.count_nonzero(many * 1.0) == 0
    assert bool((many * 1.0).ne(0).all()) and torch.tensor([1e-39]).mul(1.0).item() != 0.0


@pytest.mark.parametrize("kind", ["qwen3_5_text", "nemotron_h"])
def test_engine_decodes_with_the_compiled_steps(kind, tmp_path, monkeypatch):
    """A float32 model's decode steps never reach the torch steps."""
    path = make_hybrid_model(tmp_path, kind)
    llm = LLM(model=str(path), num_kv_blocks=16, enable_prefix_caching=False)

    def refused(*args, **kwargs):
        raise AssertionError("a decode step took the torch path")
    for module in (gated_delta, mamba2):
        monkeypatch.setattr(module, "recurrent_step", refused)
    monkeypatch.setattr(causal_conv, "causal_conv_step", refused)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9] * 11}], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)
