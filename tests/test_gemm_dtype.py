"""The quantized weights' many-row products in bfloat16 (cpu_gemm_dtype, pdserve.kernels.dequant_tiles):
the tile product against a float64 product of the same bf16-rounded operands, and the engine's
greedy tokens against the same engine in float32 and against transformers' dequantized float32
model. bf16 needs a CPU with AVX-512 BF16 or AMX: those tests skip elsewhere."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from test_gguf import reference, write_gguf

from pdserve import LLM, SamplingParams
from pdserve.kernels import dequant_tiles, native_gemv, native_rows, quant_cpu
from pdserve.testing.model_factory import assert_agrees_until_a_near_tie, assert_greedy_matches_reference

needs_bf16 = pytest.mark.skipif(not dequant_tiles.native_bf16(), reason="no AVX-512 BF16 or AMX on this CPU")


@pytest.fixture
def tile_dtype():
    """Sets this process's tile dtype (conftest.py puts it back after the test)."""
    return dequant_tiles.set_tile_dtype


def _tiles_product(x: torch.Tensor, w: np.ndarray) -> torch.Tensor:
    def fill(start: int, end: int, tile: np.ndarray) -> None:
        tile[:] = w[start:end]
    return dequant_tiles.matmul_by_tiles(x, w.shape[0], fill, 16)


@needs_bf16
@pytest.mark.parametrize("tokens", [17, 300])
def test_bf16_tiles_equal_a_float64_product_of_bf16_operands(tile_dtype, tokens):
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 576, generator=gen)
    w = torch.randn(1000, 576, generator=gen).numpy()  # more rows than one tile holds
    tile_dtype(torch.bfloat16)
    got = _tiles_product(x, w)
    exact = x.to(torch.bfloat16).double() @ torch.from_numpy(w).to(torch.bfloat16).double().T
    # float32 sums of bf16 products, the result rounded to bf16 (8 significant bits)
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-3).all()
    assert torch.equal(got.to(torch.bfloat16).float(), got)  # the bf16 path ran: every value is a bf16
    tile_dtype(torch.float32)
    full = _tiles_product(x, w)
    assert torch.allclose(full.double(), x.double() @ torch.from_numpy(w).double().T, rtol=1e-5, atol=1e-3)
    assert not torch.equal(full.to(torch.bfloat16).float(), full)


@needs_bf16
@pytest.mark.skipif(native_gemv.library() is None, reason="no compiled gemv on this machine")
@pytest.mark.parametrize("bits,tokens", [(4, 9), (4, 40), (8, 33), (8, 130)])
def test_compiled_bf16_rows_equal_a_float64_product_of_bf16_operands(tile_dtype, bits, tokens):
    """Past 8 tokens the compiled gemv's integer layouts run bf16 products (native_gemv.c's
    task_many_bf16): w dequantized then rounded to bf16, x rounded to bf16, float32 sums; up to 8
    tokens, and with float32 set, every product stays float32."""
    rng = np.random.default_rng(bits + tokens)
    w, packed = _grouped_matrix(rng, bits)
    x = torch.from_numpy(rng.standard_normal((tokens, w.shape[1])).astype(np.float32))
    bf16 = torch.from_numpy(w).float().to(torch.bfloat16).double()
    exact = x.to(torch.bfloat16).double() @ bf16.T
    full = x.double() @ torch.from_numpy(w).T
    tile_dtype(torch.bfloat16)
    got = _compiled(x, packed)
    assert torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-4)  # float32 sums of the bf16 products
    assert not torch.allclose(got.double(), full, rtol=1e-5, atol=1e-4)  # (not float32's products)
    assert torch.allclose(_compiled(x[:8], packed).double(), full[:8], rtol=1e-5, atol=1e-4)
    tile_dtype(torch.float32)
    assert torch.allclose(_compiled(x, packed).double(), full, rtol=1e-5, atol=1e-4)


def _grouped_matrix(rng, bits: int, rows: int = 70, cols: int = 192, group: int = 32):
    """A random 4- or 8-bit matrix with float32 scales and mins: (its float64 values, packed)."""
    q = rng.integers(0, 16 if bits == 4 else 127, (rows, cols)).astype(np.uint8 if bits == 4 else np.int8)
    scales = (rng.random((rows, cols // group)) * 0.1 + 0.01).astype(np.float32)
    mins = (rng.random((rows, cols // group)) * -0.5).astype(np.float32)
    w = q.astype(np.float64) * np.repeat(scales, group, 1) + np.repeat(mins, group, 1)
    packed = quant_cpu.PackedMatrix.of(bits, torch.from_numpy(_pack(q, bits)), torch.from_numpy(scales),
                                       torch.from_numpy(mins), group)
    return w, packed


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return q
    runs = q.reshape(q.shape[0], -1, 2, 16)  # quant_cpu's order: column j low nibble, j + 16 high
    return np.ascontiguousarray((runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(q.shape[0], -1))


def _compiled(x: torch.Tensor, packed) -> torch.Tensor:
    out = torch.empty(x.shape[0], packed.q.shape[0])
    assert native_gemv.run(x.data_ptr(), x.shape[0], x.shape[1], packed.native, out.data_ptr())
    return out


@needs_bf16
@pytest.mark.skipif(not dequant_tiles.native_amx() or native_gemv.library() is None,
                    reason="no AMX tiles or no compiled gemv on this machine")
def test_amx_products_take_the_compiled_kernel_up_to_its_rows(tile_dtype, monkeypatch):
    """Under bf16 products on AMX's tiles a quantized matrix's products of up to AMX_MAX_TOKENS
    rows (a large decode step's LM head) run in the compiled kernel: float32 sums of bf16
    products, exact against float64. Past them, dequantized tiles through oneDNN (its results
    rounded to bf16); under float32 products the compiled kernel stops at MAX_TOKENS."""
    rng = np.random.default_rng(7)
    w, packed = _grouped_matrix(rng, 4)
    cols = w.shape[1]
    bf16_w = torch.from_numpy(w).float().to(torch.bfloat16).double()
    calls = []
    real = native_gemv.run
    monkeypatch.setattr(native_gemv, "run", lambda *a: calls.append(a[1]) or real(*a))
    tile_dtype(torch.bfloat16)
    most = native_gemv.AMX_MAX_TOKENS
    for tokens in (64, most):
        x = torch.from_numpy(rng.standard_normal((tokens, cols)).astype(np.float32))
        got = quant_cpu.packed_matmul(x, packed)
        assert calls[-1] == tokens
        assert torch.allclose(got.double(), x.to(torch.bfloat16).double() @ bf16_w.T, rtol=1e-5, atol=1e-4)
    x = torch.from_numpy(rng.standard_normal((most + 1, cols)).astype(np.float32))
    got = quant_cpu.packed_matmul(x, packed)
    assert calls == [64, most] and torch.equal(got.to(torch.bfloat16).float(), got)
    tile_dtype(torch.float32)
    quant_cpu.packed_matmul(x[:64], packed)
    assert calls == [64, most]


def test_bf16_is_refused_without_native_dot_products(monkeypatch):
    monkeypatch.setattr(dequant_tiles, "native_bf16", lambda: False)
    with pytest.raises(ValueError, match="AVX-512 BF16"):
        dequant_tiles.resolve_gemm_dtype("bfloat16")
    assert dequant_tiles.resolve_gemm_dtype("float32") == torch.float32


@pytest.mark.parametrize("native, env, want", [
    (True, None, torch.bfloat16), (False, None, torch.float32),
    (True, "float32", torch.float32), (True, "bfloat16", torch.bfloat16)])
def test_auto_is_bf16_where_the_cpu_has_it_unless_the_environment_says(monkeypatch, native, env, want):
    """auto (the default): bf16 products on a CPU with native bf16 dot products, float32 elsewhere;
    $PDSERVE_CPU_GEMM_DTYPE, where set, decides (the suite pins float32 there, see conftest)."""
    monkeypatch.setattr(dequant_tiles, "native_bf16", lambda: native)
    if env is None:
        monkeypatch.delenv(dequant_tiles.GEMM_DTYPE_ENV, raising=False)
    else:
        monkeypatch.setenv(dequant_tiles.GEMM_DTYPE_ENV, env)
    assert dequant_tiles.resolve_gemm_dtype("auto") == want
    assert dequant_tiles.resolve_gemm_dtype("float32") == torch.float32  # a flag always wins


@needs_bf16
def test_default_engine_takes_bf16_products_without_the_suites_pin(monkeypatch, tile_dtype):
    """A default engine (no cpu_gemm_dtype given) on this bf16 CPU, with the suite's pin removed,
    runs its tiles in bf16: its greedy tokens equal an engine given bfloat16 outright."""
    monkeypatch.delenv(dequant_tiles.GEMM_DTYPE_ENV)
    prompts = [[(5 * i + 11) % 200 + 3 for i in range(n)] for n in (40, 70)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    runs = {}
    for name in ("auto", "bfloat16"):
        llm = LLM("builtin:tiny", num_kv_blocks=64, **({} if name == "auto" else {"cpu_gemm_dtype": name}))
        assert dequant_tiles.tile_dtype() == torch.bfloat16
        runs[name] = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert runs["auto"] == runs["bfloat16"]


@needs_bf16
def test_bf16_engine_stays_near_the_float32_engine(tmp_path, tile_dtype):
    """Prompts long enough for the tiles (past the gemv's 16 tokens), a Q4_1 Llama: float32 greedy
    tokens equal transformers' float32 ones; bf16's prompt logits are within bf16's rounding of
    float32's (and not equal to them: the bf16 products ran), and its greedy tokens agree with
    float32's until the first near-tie (top-2 gap under the logit error) of the float32 run."""
    path = write_gguf(tmp_path / "llama.Q4_1.gguf", "llama", Q.Q4_1)
    _, ref = reference(path)
    prompts = [[(7 * i + 3 * n) % ref.config.vocab_size for i in range(n)] for n in (24, 57, 90)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    runs, logits = {}, {}
    for name in ("float32", "bfloat16"):
        llm = LLM(str(path), num_kv_blocks=64, cpu_gemm_dtype=name)
        assert dequant_tiles.tile_dtype() == getattr(torch, name)
        if name == "float32":
            assert_greedy_matches_reference(llm, ref, prompts, 12, name)
        runs[name] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        logits[name] = llm.engine.prompt_logits(prompts[-1])
    diff = (logits["bfloat16"] - logits["float32"]).abs().max().item()
    assert 0 < diff < 0.05 * logits["float32"].abs().max().item()
    assert_agrees_until_a_near_tie(runs["float32"], runs["bfloat16"], 4 * diff)


@needs_bf16
def test_float32_weights_take_bf16_products_past_16_rows(tile_dtype):
    """Unquantized layers (a bf16 checkpoint served in float32): bf16 products past 16 rows in the
    Python layers (oneDNN) and past 8 in the compiled gemv (float32 rows rounded as read)."""
    from pdserve.kernels.native_matrices import float_matrix
    from pdserve.layers.quant.unquantized import UnquantizedLinearMethod

    gen = torch.Generator().manual_seed(3)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(96, 128, generator=gen), requires_grad=False)
    x = torch.randn(40, 128, generator=gen)
    exact = x.to(torch.bfloat16).double() @ layer.weight.to(torch.bfloat16).double().T
    full = x.double() @ layer.weight.double().T
    tile_dtype(torch.bfloat16)
    got = UnquantizedLinearMethod().apply(layer, x, None)
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-3).all()
    assert not torch.allclose(got.double(), full, rtol=1e-5, atol=1e-4)
    assert torch.allclose(UnquantizedLinearMethod().apply(layer, x[:16], None).double(), full[:16], atol=1e-4)
    if native_gemv.library() is not None:
        out = torch.empty(40, 96)
        assert native_gemv.run(x.data_ptr(), 40, 128, float_matrix(layer.weight), out.data_ptr())
        assert torch.allclose(out.double(), exact, rtol=1e-5, atol=1e-4)


@needs_bf16
def test_tile_conversions_are_torchs():
    """The bf16 tile product's own conversions (native_tiles.c): x rounded as x.to(bfloat16)
    rounds it (normal values; a ragged tail past the last 32), the bf16 result widened exactly
    into strided columns of the float32 output, its neighbours untouched."""
    x = torch.randn(67, 45, generator=torch.Generator().manual_seed(5)) * 100
    assert torch.equal(native_rows.round_bf16(x).view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    src = (torch.randn(67, 45) * 100).to(torch.bfloat16)
    out = torch.full((67, 60), 7.0)
    native_rows.widen_bf16_into(src, out[:, 5:50])
    assert torch.equal(out[:, 5:50], src.float())
    assert bool((out[:, :5] == 7.0).all()) and bool((out[:, 50:] == 7.0).all())


@needs_bf16
def test_many_row_norms_rope_and_silu_run_compiled_under_bf16(tile_dtype, monkeypatch):
    """Past numba_fused.PARALLEL_ROWS, under bf16 products, the residual add + RMSNorm, RoPE and
    the MLP's SiLU(gate) * up run in native_rows.c on every thread (numba's one-thread kernels and
    torch's SiLU never called), with their values up to the order of the sums and the exponential;
    float32 keeps numba's kernels and torch's SiLU."""
    from pdserve.kernels import numba_fused
    gen = torch.Generator().manual_seed(11)
    rows = numba_fused.PARALLEL_ROWS + 5
    x, delta, w = (torch.randn(rows, 576, generator=gen), torch.randn(rows, 576, generator=gen),
                   torch.randn(576, generator=gen))
    qkv = torch.randn(rows, 15 * 64, generator=gen)
    cos, sin = torch.randn(rows, 1, 64, generator=gen), torch.randn(rows, 1, 64, generator=gen)
    gate_up = torch.randn(rows, 2 * 1536, generator=gen) * 4
    tile_dtype(torch.float32)
    want_act = numba_fused.silu_mul(gate_up)
    torch.testing.assert_close(want_act, F.silu(gate_up[:, :1536]) * gate_up[:, 1536:], rtol=0, atol=0)
    want_sum, want_norm = numba_fused.rms_norm(x, w, 1e-5, delta)
    want_qkv = qkv.clone()
    numba_fused.rope_(want_qkv[:, :576].view(rows, 9, 64), want_qkv[:, 576:768].view(rows, 3, 64), cos, sin)
    tile_dtype(torch.bfloat16)
    monkeypatch.setattr(numba_fused, "_rms_norm", None)  # a call would fail: the compiled rows must run
    monkeypatch.setattr(numba_fused, "_rope", None)
    monkeypatch.setattr(numba_fused.F, "silu", None)
    got_act = numba_fused.silu_mul(gate_up)
    torch.testing.assert_close(got_act, want_act, rtol=1e-5, atol=1e-5)
    got_sum, got_norm = numba_fused.rms_norm(x, w, 1e-5, delta)
    numba_fused.rope_(qkv[:, :576].view(rows, 9, 64), qkv[:, 576:768].view(rows, 3, 64), cos, sin)
    assert torch.equal(got_sum, want_sum)
    torch.testing.assert_close(got_norm, want_norm, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(qkv, want_qkv, rtol=1e-6, atol=1e-6)


@needs_bf16
@pytest.mark.parametrize("q_heads,k_heads,dim", [(9, 3, 64), (3, 1, 6)])
def test_widen_rope_is_the_widening_then_rope(tile_dtype, q_heads, k_heads, dim):
    """numba_fused.widen_rope (native_rows.c): a bf16 qkv product's rows widened and q's and k's
    heads rotated in one pass give, bit for bit, the rows widened by torch then rope_ (rows of 576
    + 2 x 192 columns, and of 30: past the 16-lane loop); v as widened; below
    PARALLEL_ROWS, or under float32 products, it declines (the caller takes the two steps)."""
    from pdserve.kernels import numba_fused
    gen = torch.Generator().manual_seed(13)
    rows, width = numba_fused.PARALLEL_ROWS + 7, (q_heads + 2 * k_heads) * dim
    qkv = torch.randn(rows, width, generator=gen).bfloat16()
    cos, sin = torch.randn(rows, 1, dim, generator=gen), torch.randn(rows, 1, dim, generator=gen)
    tile_dtype(torch.bfloat16)
    want = qkv.float()
    numba_fused.rope_(want[:, :q_heads * dim].view(rows, q_heads, dim),
                      want[:, q_heads * dim:(q_heads + k_heads) * dim].view(rows, k_heads, dim), cos, sin)
    got = numba_fused.widen_rope(qkv, q_heads, k_heads, cos, sin)
    assert got is not None and torch.equal(got, want)
    assert numba_fused.widen_rope(qkv[:numba_fused.PARALLEL_ROWS - 1], q_heads, k_heads,
                                  cos[:numba_fused.PARALLEL_ROWS - 1], sin[:numba_fused.PARALLEL_ROWS - 1]) is None
    tile_dtype(torch.float32)
    assert numba_fused.widen_rope(qkv, q_heads, k_heads, cos, sin) is None


@needs_bf16
def test_bf16_mlp_keeps_gate_up_in_bf16(tmp_path, tile_dtype, monkeypatch):
    """Under bf16 products a many-row MLP step goes gate_up -> SiLU * up -> down in bf16
    (layers/bf16_mlp.py): the layers' values (gate_up widened, torch's SiLU and multiply, rounded
    again for down) up to SiLU's exponential; few rows (those the compiled kernel takes) and float32
    never take it."""
    from pdserve.layers import bf16_mlp
    llm = LLM(str(write_gguf(tmp_path / "llama.Q4_1.gguf", "llama", Q.Q4_1)), num_kv_blocks=64,
              cpu_gemm_dtype="bfloat16")
    mlp = next(m for m in llm.engine.runner.model.modules() if type(m).__name__ == "MLP")
    fewest = max(bf16_mlp.MIN_ROWS, native_gemv.max_tokens() + 1)  # (fewer: the compiled kernel's rows)
    x = torch.randn(fewest + 7, mlp.gate_up_proj.input_size, generator=torch.Generator().manual_seed(4))
    assert bf16_mlp.gate_up_silu_down(mlp.gate_up_proj, mlp.down_proj, x) is not None
    assert bf16_mlp.gate_up_silu_down(mlp.gate_up_proj, mlp.down_proj, x[:fewest - 1]) is None
    got = mlp(x)
    monkeypatch.setattr(bf16_mlp, "MIN_ROWS", 1 << 30)
    want = mlp(x)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    tile_dtype(torch.float32)
    monkeypatch.undo()
    assert bf16_mlp.gate_up_silu_down(mlp.gate_up_proj, mlp.down_proj, x) is None


@needs_bf16
@pytest.mark.parametrize("kind", ["qwen3_5_text", "nemotron_h", "falcon_h1"])
def test_hybrid_projections_take_bf16_products(tmp_path, tile_dtype, kind):
    """A hybrid's linear-attention or Mamba2, attention and MLP projections (FloatLinear) follow
    cpu_gemm_dtype as the other families' layers do. Under bfloat16 a prompt's logits move off
    float32's (the bf16 products ran; float32's equal transformers', test_models_hybrid), and no
    further than transformers' own model loaded in bf16 moves off its float32 one (these random
    checkpoints amplify rounding: the delta rule's decays compound it over the prompt); batched
    greedy decoding agrees with float32's until the first near-tie."""
    from family_models import random_prompts
    from transformers import AutoModelForCausalLM

    from pdserve.layers.quant.unquantized import FloatLinear
    from pdserve.testing.hybrid_checkpoints import make_hybrid_model

    path = make_hybrid_model(tmp_path, kind)
    prompts = random_prompts(3, 256, (40, 90, 150))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    runs, logits, theirs = {}, {}, {}
    for name in ("float32", "bfloat16"):
        llm = LLM(model=str(path), num_kv_blocks=64, cpu_gemm_dtype=name, enable_prefix_caching=False)
        assert any(isinstance(m, FloatLinear) for m in llm.engine.runner.model.modules())
        runs[name] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        logits[name] = llm.engine.prompt_logits(prompts[-1])
        with torch.no_grad():
            ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, name))
            theirs[name] = ref(torch.tensor([prompts[-1]])).logits[0].float()
    diff = (logits["bfloat16"] - logits["float32"]).abs().max().item()
    assert 0 < diff <= (theirs["bfloat16"] - theirs["float32"]).abs().max().item()
    assert_agrees_until_a_near_tie(runs["float32"], runs["bfloat16"], 4 * diff)


@needs_bf16
def test_a_hybrid_mlps_prefill_rows_go_from_gate_up_to_down_in_bf16(tile_dtype, monkeypatch):
    """The hybrids' SwiGLU MLP (DenseMLP of FloatLinear layers) under bfloat16: a prefill's rows
    (past the AMX tiles' 512, or past 16 without AMX) take gate_up's bf16 result through SiLU * up in one compiled pass
    into down's bf16 input (float_swiglu_bf16), with the values of the layers' path (which widens,
    runs SiLU * up in float32 and rounds back); a decode step's rows keep the layers."""
    from pdserve.layers.quant import unquantized
    from pdserve.models import moe

    dequant_tiles.set_tile_dtype(torch.bfloat16)
    torch.manual_seed(0)
    mlp = moe.DenseMLP(128, 384, linear=unquantized.FloatLinear)
    took = []
    monkeypatch.setattr(moe, "float_swiglu_bf16", lambda *a: took.append(unquantized.float_swiglu_bf16(*a)) or took[-1])
    # a decode step's rows: BF16_MIN_ROWS keep the layers with or without AMX (past them a CPU
    # without AMX's tiles takes the one oneDNN pass already)
    for rows, fused in ((600, True), (unquantized.BF16_MIN_ROWS, False)):
        x = torch.randn(rows, 128)
        want = mlp.down_proj(moe.silu_mul(mlp.gate_up_proj(x)))
        took.clear()
        got = mlp(x)
        assert (took[-1] is not None) == fused
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)


@needs_bf16
def test_an_lm_heads_logits_past_16_rows_are_float32_sums_of_bf16_products(tile_dtype):
    """An unquantized LM head under bfloat16 at 40 rows (a decode step's, past the exact bf16 rows'
    16): the float32 sums of bf16 products (float64's of the bf16-rounded operands, within float32
    rounding), on a CPU with AMX's tiles or with AVX-512 BF16 alone, not the float32 product."""
    from pdserve.layers.vocab import ParallelLMHead

    gen = torch.Generator().manual_seed(3)
    head = ParallelLMHead(1000, 128)
    head.weight.data.copy_(torch.randn(1000, 128, generator=gen))
    x = torch.randn(40, 128, generator=gen)
    dequant_tiles.set_tile_dtype(torch.bfloat16)
    got = head(x).double()
    assert torch.allclose(got, x.bfloat16().double() @ head.weight.bfloat16().double().T, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(got, x.double() @ head.weight.double().T, rtol=1e-5, atol=1e-4)


@needs_bf16
def test_a_hybrids_lm_head_takes_bf16_products(tmp_path, tile_dtype):
    """The hybrids' LM head (a FloatLMHead, a FloatLinear as their layers' projections) follows
    cpu_gemm_dtype: under bfloat16 a decode step's 32 rows of logits are float32 sums of bf16
    products (float64's of the bf16-rounded operands, within float32 rounding), on a CPU without
    AMX too, where FloatLinear's oneDNN pass returned them rounded to bf16; not the float32
    product's values."""
    from pdserve.testing.hybrid_checkpoints import make_hybrid_model

    llm = LLM(model=str(make_hybrid_model(tmp_path, "qwen3_5_text")), num_kv_blocks=64, cpu_gemm_dtype="bfloat16")
    model = llm.engine.runner.model
    hidden = torch.randn(32, model.lm_head.in_features)
    got = model.compute_logits(hidden).double()
    want = hidden.bfloat16().double() @ model.lm_head.weight.bfloat16().double().T
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(got, F.linear(hidden, model.lm_head.weight).double(), rtol=1e-5, atol=1e-4)


def test_a_bf16_hybrid_checkpoint_decodes_on_its_exact_bf16_rows(tmp_path):
    """A hybrid checkpoint saved in bf16 (as Qwen3.5's are), served in float32: its projections'
    weights are exactly bf16, so a decode step's few rows multiply the bf16 rows themselves (the
    compiled gemv, widened exactly: half the bytes) whatever cpu_gemm_dtype says, and greedy
    decoding equals transformers' float32 model of the same bf16 weights."""
    from family_models import random_prompts
    from transformers import AutoModelForCausalLM

    from pdserve.layers.quant.unquantized import FloatLinear
    from pdserve.testing.hybrid_checkpoints import load_reference, make_hybrid_model

    path = make_hybrid_model(tmp_path, "qwen3_5_text")  # saved again in bf16 over itself (the tokenizer stays)
    AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).save_pretrained(str(path))
    ref = load_reference(path)  # float32, from the bf16 weights
    llm = LLM(model=str(path), num_kv_blocks=64, enable_prefix_caching=False)
    prompts = random_prompts(4, ref.config.vocab_size, (20, 37))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                        use_tqdm=False)]
    for prompt, ids in zip(prompts, got):
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(prompt):].tolist()
        assert ids == want
    floats = [m for m in llm.engine.runner.model.modules() if isinstance(m, FloatLinear)]
    assert floats and all(m.__dict__.get("_bf16_exact", (0, False))[1] for m in floats)


@needs_bf16
@pytest.mark.skipif(not dequant_tiles.avx512_bf16(), reason="the norm's rounding needs AVX-512 BF16")
def test_bf16_rows_between_norms_and_products_give_the_same_logits(tmp_path, tile_dtype, monkeypatch):
    """Under bf16 products a many-row step keeps bf16 between its norms and products
    (layers/bf16_rows.py: the norm rounds its rows, o's and down's results go to the next residual
    add unwidened): a 300-token prompt's logits equal, bit for bit, those of the same engine with
    the float32 rows in between; the rounding norm ran (a layer for each of its norms but the last)."""
    from pdserve.kernels import numba_fused
    from pdserve.layers import bf16_rows
    llm = LLM(str(write_gguf(tmp_path / "llama.Q4_1.gguf", "llama", Q.Q4_1)), num_kv_blocks=64,
              cpu_gemm_dtype="bfloat16", enable_prefix_caching=False)
    prompt = torch.randint(3, 200, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    calls = []
    rounding_norm = numba_fused.rms_norm_low
    monkeypatch.setattr(numba_fused, "rms_norm_low", lambda *a, **k: calls.append(1) or rounding_norm(*a, **k))
    got = llm.engine.prompt_logits(prompt)
    layers = len(llm.engine.runner.model.layers)
    assert len(calls) == 2 * layers
    monkeypatch.setattr(bf16_rows, "step_takes", lambda *a: False)
    want = llm.engine.prompt_logits(prompt)
    assert len(calls) == 2 * layers and torch.equal(got, want)
