"""int8 products (cpu_gemm_dtype int8, native_gemv_int8.c): 4- and 8-bit weight codes times
int8-quantized activations with AVX-512 VNNI, as llama.cpp multiplies Q4/Q8 blocks. The kernel is
checked against a float64 product of the exact weights with x rounded per token and block of 32
as Q8_0 rounds it, and an engine under int8 against the float32 engine. They skip on CPUs without AVX-512 VNNI."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_gguf import reference, write_gguf

from pdserve import LLM, SamplingParams
from pdserve.kernels import dequant_tiles, native_gemv, quant_cpu
from pdserve.testing.model_factory import assert_agrees_until_a_near_tie

needs_int8 = pytest.mark.skipif(native_gemv.library() is None or not dequant_tiles.native_int8(),
                                reason="no compiled kernels or no AVX-512 VNNI on this CPU")


@pytest.fixture
def gemm_dtype(monkeypatch):
    """Sets this process's product dtype (conftest.py puts it back after the test). int8 runs at
    every row count here, on a CPU with AMX too (where the engine hands rows past
    INT8_MAX_ROWS_AMX to bf16 tiles; see test_amx_cpus_take_int8_up_to_the_crossover_and_bf16_past_it)."""
    monkeypatch.setattr(dequant_tiles, "INT8_MAX_ROWS_AMX", None)
    return dequant_tiles.set_tile_dtype


def _matrix(rng, bits: int, rows: int, cols: int, group: int, has_min: bool, half: bool):
    """quant_cpu's layout: codes (4 bits two a byte, column j low nibble and j + 16 high), scales
    and mins a group; and the codes, scales and mins as float64 per column"""
    codes = rng.integers(0, 16, (rows, cols)) if bits == 4 else rng.integers(-128, 128, (rows, cols))
    if bits == 4:
        runs = codes.reshape(rows, -1, 2, 16).astype(np.uint8)
        q = np.ascontiguousarray((runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(rows, -1))
    else:
        q = codes.astype(np.int8).view(np.uint8)
    scales = (rng.random((rows, cols // group)) * 0.02 + 0.001).astype(np.float32)
    mins = ((rng.random((rows, cols // group)) - 0.5) * 0.1).astype(np.float32)
    stored = [a.astype(np.float16) if half else a for a in (scales, mins)]
    per_column = [np.repeat(a.astype(np.float64), group, axis=1) for a in stored]
    bits_of = [a.view(np.uint16) if half else a for a in stored]
    mins_arg = bits_of[1] if has_min else np.zeros((rows, 0), bits_of[0].dtype)
    return (q, bits_of[0], mins_arg), codes.astype(np.float64), per_column[0], per_column[1] if has_min else 0.0


def _int8_reference(x: np.ndarray, codes, scale, minimum) -> np.ndarray:
    """x rounded per block as Q8_0 rounds it, times the exact weights (d * q + min), in float64"""
    tokens, cols = x.shape
    blocks = x.reshape(tokens, cols // 32, 32)
    amax = np.abs(blocks).max(axis=2)
    inverse = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    c = np.rint(blocks * inverse[:, :, None]).astype(np.float64)  # x * (127 / amax) in float32, as the kernel
    xq = (c * (amax / np.float32(127)).astype(np.float64)[:, :, None]).reshape(tokens, cols)
    return xq @ (codes * scale + minimum).T


def _run(x: np.ndarray, matrix, bits: int, has_min: bool, group: int) -> np.ndarray:
    out = native_gemv.gemv(np.ascontiguousarray(x), bits, *matrix, has_min, group)
    assert out is not None
    return out.astype(np.float64)


def _run_packed(x: np.ndarray, matrix, bits: int, has_min: bool, group: int) -> np.ndarray:
    """The same product read from the matrix's int8 pack (as a layer's PackedMatrix holds it)."""
    args = native_gemv.matrix_args(bits, *matrix, has_min, group)
    pack = native_gemv.int8_pack(args, x.shape[1])
    assert pack is not None and pack.ctypes.data % 64 == 0
    out = np.empty((x.shape[0], matrix[0].shape[0]), dtype=np.float32)
    assert native_gemv.run(np.ascontiguousarray(x).ctypes.data, x.shape[0], x.shape[1],
                           native_gemv.with_int8_pack(args, pack), out.ctypes.data)
    return out.astype(np.float64)


@needs_int8
@pytest.mark.parametrize("bits, has_min, half, group", [
    (4, True, True, 32), (4, False, True, 32), (8, False, True, 32), (4, True, False, 64), (8, True, False, 32)])
@pytest.mark.parametrize("tokens", [1, 2, 7, 9, 33, 200])
@pytest.mark.parametrize("packed", [False, True], ids=["packed-per-call", "int8-pack"])
def test_int8_rows_equal_a_float64_evaluation_of_the_same_arithmetic(gemm_dtype, bits, has_min, half, group, tokens,
                                                                      packed):
    """Rows past a multiple of 16 (the last task's tail) and 16 (the transposed scales), token counts
    around the kernel's 8-token passes and its 192-token sweeps, both scale widths, groups of 64;
    each task's rows packed by the call, or read from the matrix's pack made once."""
    rng = np.random.default_rng(bits * 1000 + tokens)
    rows, cols = 37, 576
    matrix, codes, scale, minimum = _matrix(rng, bits, rows, cols, group, has_min, half)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    gemm_dtype(torch.int8)
    got = (_run_packed if packed else _run)(x, matrix, bits, has_min, group)
    exact = x.astype(np.float64) @ (codes * scale + minimum).T
    if bits == 8 and tokens < (2 if packed else 8):  # 8-bit codes stay float32 below these (faster there)
        assert np.allclose(got, exact, rtol=1e-5, atol=1e-5)
        return
    want = _int8_reference(x, codes, scale, minimum)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert 0 < np.abs(got - exact).max() < 0.02 * np.abs(exact).max()  # Q8_0's rounding of x, no more


@needs_int8
@pytest.mark.skipif("amx_int8" not in dequant_tiles._cpu_flags(), reason="no AMX int8 tiles on this CPU")
@pytest.mark.parametrize("bits, has_min, half, group, cols", [
    (4, True, True, 32, 576), (8, False, True, 32, 576), (4, True, False, 64, 320), (8, True, False, 32, 320)])
@pytest.mark.parametrize("tokens", [16, 17, 40, 200])
def test_amx_int8_tiles_give_vnnis_products_bit_for_bit(gemm_dtype, bits, has_min, half, group, cols, tokens):
    """A pack's products on AMX's int8 tiles (native_gemv_int8_amx.c) equal VNNI's bit for bit:
    token counts past a 16-token tile and the 192-token sweeps, blocks past a multiple of four
    (18 and 10 blocks of 32 columns), rows past a task's 16, both scale widths, 4- and 8-bit codes;
    and the tiles ran (their call count moved) where VNNI's run did not move it."""
    rng = np.random.default_rng(bits * 1000 + tokens)
    matrix, *_ = _matrix(rng, bits, 37, cols, group, has_min, half)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    gemm_dtype(torch.int8)
    before = native_gemv.set_int8_amx_min_tokens(1 << 30)
    try:
        calls = native_gemv.int8_amx_calls()
        vnni = _run_packed(x, matrix, bits, has_min, group)
        assert native_gemv.int8_amx_calls() == calls
        native_gemv.set_int8_amx_min_tokens(1)
        tiles = _run_packed(x, matrix, bits, has_min, group)
        assert native_gemv.int8_amx_calls() > calls
    finally:
        native_gemv.set_int8_amx_min_tokens(before)
    assert np.array_equal(tiles, vnni)


@needs_int8
@pytest.mark.parametrize("bits, half", [(4, True), (8, False)])
def test_a_layers_int8_pack_gives_the_per_call_values_bit_for_bit(gemm_dtype, bits, half):
    """A layer's PackedMatrix holds its matrix's int8 pack under int8 products only, and products
    read from it equal those whose call packs each task itself, bit for bit."""
    rng = np.random.default_rng(bits)
    (q, scales, mins), *_ = _matrix(rng, bits, 50, 320, 32, True, half)
    args = [torch.from_numpy(a) for a in (q, scales, mins)]
    gemm_dtype(torch.float32)
    assert quant_cpu.PackedMatrix.of(bits, *args, 32).int8_pack is None
    gemm_dtype(torch.int8)
    layer = quant_cpu.PackedMatrix.of(bits, *args, 32)
    assert layer.int8_pack is not None and layer.native[-1] == layer.int8_pack.ctypes.data
    x = torch.from_numpy(rng.standard_normal((24, 320)).astype(np.float32))
    assert torch.equal(quant_cpu.packed_matmul(x, layer), torch.from_numpy(_run(x.numpy(), (q, scales, mins), bits,
                                                                               True, 32)).float())


@needs_int8
@pytest.mark.parametrize("tokens", [1, 9])
def test_float32_setting_keeps_the_float32_kernels(gemm_dtype, tokens):
    """Under float32 the same call is exact (the float32 kernels); under int8 it is the int8 product,
    a single token's too."""
    rng = np.random.default_rng(3)
    matrix, codes, scale, minimum = _matrix(rng, 4, 48, 256, 32, True, True)
    x = rng.standard_normal((tokens, 256)).astype(np.float32)
    exact = x.astype(np.float64) @ (codes * scale + minimum).T
    gemm_dtype(torch.int8)
    got = _run(x, matrix, 4, True, 32)
    assert np.abs(got - _int8_reference(x, codes, scale, minimum)).max() <= 1e-5 * np.abs(exact).max()
    assert not np.allclose(got, exact, rtol=1e-5, atol=1e-5)
    gemm_dtype(torch.float32)
    assert np.allclose(_run(x, matrix, 4, True, 32), exact, rtol=1e-5, atol=1e-5)


def test_int8_names_its_dtypes(monkeypatch, gemm_dtype):
    """int8 is refused without VNNI; set, the tiles of other matrices run bf16 (float32 without
    native bf16) and a TP worker is told int8."""
    monkeypatch.setattr(dequant_tiles, "native_int8", lambda: False)
    with pytest.raises(ValueError, match="AVX-512 VNNI"):
        dequant_tiles.resolve_gemm_dtype("int8")
    monkeypatch.setattr(dequant_tiles, "native_int8", lambda: True)
    assert dequant_tiles.resolve_gemm_dtype("int8") == torch.int8
    for native_bf16, tiles in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(dequant_tiles, "native_bf16", lambda native_bf16=native_bf16: native_bf16)
        gemm_dtype(torch.int8)
        assert (dequant_tiles.tile_dtype(), dequant_tiles.gemm_dtype(), dequant_tiles.int8_products()) == (
            tiles, torch.int8, True)
    gemm_dtype(torch.float32)
    assert not dequant_tiles.int8_products()


@needs_int8
@pytest.mark.parametrize("kind", [Q.Q4_1, Q.Q8_0])
def test_int8_engine_stays_near_the_float32_engine(tmp_path, gemm_dtype, kind):
    """A GGUF Llama's prompt logits under int8 (prefill through the int8 kernel at every row count)
    are within Q8 activations' rounding of float32's, and neither float32's nor bf16's (the int8
    products ran); its greedy tokens agree with float32's until float32's first near-tie."""
    path = write_gguf(tmp_path / f"llama.{kind.name}.gguf", "llama", kind)
    _, ref = reference(path)
    prompts = [[(7 * i + 3 * n) % ref.config.vocab_size for i in range(n)] for n in (5, 57, 90)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    runs, logits = {}, {}
    names = ("float32", "bfloat16", "int8") if dequant_tiles.native_bf16() else ("float32", "int8")
    for name in names:
        llm = LLM(str(path), num_kv_blocks=64, cpu_gemm_dtype=name)
        assert dequant_tiles.gemm_dtype() == getattr(torch, name)
        runs[name] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        logits[name] = llm.engine.prompt_logits(prompts[-1])
    scale = logits["float32"].abs().max().item()
    diff = (logits["int8"] - logits["float32"]).abs().max().item()
    assert 0 < diff < 0.1 * scale
    if "bfloat16" in logits:
        assert not torch.equal(logits["int8"], logits["bfloat16"])
    assert_agrees_until_a_near_tie(runs["float32"], runs["int8"], 4 * diff)


@pytest.mark.parametrize("gguf, vnni, bf16, amx, want", [
    (True, True, True, False, torch.int8), (True, False, True, False, torch.bfloat16),
    (False, True, True, False, torch.bfloat16), (True, True, False, False, torch.int8),
    (False, True, False, False, torch.float32), (True, True, True, True, torch.int8),
    (False, True, True, True, torch.bfloat16)])
def test_auto_takes_int8_for_a_gguf_where_the_cpu_has_vnni(monkeypatch, gguf, vnni, bf16, amx, want):
    """auto without the suite's pin: a GGUF's blocks multiply as llama.cpp multiplies them where the
    CPU has VNNI (with AMX, up to INT8_MAX_ROWS_AMX rows); other checkpoints keep bf16 (or
    float32); the environment and a flag still win."""
    monkeypatch.delenv(dequant_tiles.GEMM_DTYPE_ENV, raising=False)
    monkeypatch.setattr(dequant_tiles, "native_int8", lambda: vnni)
    monkeypatch.setattr(dequant_tiles, "native_bf16", lambda: bf16)
    monkeypatch.setattr(dequant_tiles, "native_amx", lambda: amx)
    assert dequant_tiles.resolve_gemm_dtype("auto", gguf=gguf) == want
    assert dequant_tiles.resolve_gemm_dtype("float32", gguf=gguf) == torch.float32
    monkeypatch.setenv(dequant_tiles.GEMM_DTYPE_ENV, "float32")
    assert dequant_tiles.resolve_gemm_dtype("auto", gguf=gguf) == torch.float32


@needs_int8
def test_default_gguf_engine_takes_int8_and_a_bf16_cache(tmp_path, monkeypatch, gemm_dtype):
    """A default engine on a GGUF without the suite's pin: int8 products and a bf16 K/V cache, the
    same tokens as an engine given both outright; float32 products keep a float32 cache."""
    monkeypatch.delenv(dequant_tiles.GEMM_DTYPE_ENV)
    path = write_gguf(tmp_path / "llama.Q4_1.gguf", "llama", Q.Q4_1)
    prompts = [[(5 * i + 11) % 200 + 3 for i in range(n)] for n in (40, 70)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    runs = {}
    for name, flags in (("auto", {}), ("given", {"cpu_gemm_dtype": "int8", "kv_cache_dtype": "bfloat16"}),
                        ("float32", {"cpu_gemm_dtype": "float32"})):
        llm = LLM(str(path), num_kv_blocks=64, **flags)
        want = (torch.float32, torch.float32) if name == "float32" else (torch.int8, torch.bfloat16)
        assert (dequant_tiles.gemm_dtype(), llm.engine.kv_cache.dtype) == want
        linear = name != "float32" and not dequant_tiles.native_amx()  # the step's default budget follows
        assert llm.engine.config.max_num_batched_tokens == (1024 if linear else 2048)
        runs[name] = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert runs["auto"] == runs["given"]


def test_a_steps_default_budget_is_1024_tokens_where_products_need_no_dequantizing_without_amx(
        monkeypatch, gemm_dtype):
    """max_num_batched_tokens unset: 1,024 tokens on a CPU without AMX whose products run int8, or
    bf16 over weights that are not quantized (there a step's cost grows with its tokens from the
    first), 2,048 under AMX's tiles (AMX stood in for where absent), for bf16 products over
    quantized weights (dequantized a step), under float32 products and on CUDA; a budget given wins."""
    from pdserve.assembly import setup
    from pdserve.engine.config import EngineConfig
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for products in (torch.int8, torch.bfloat16, torch.float32):
        if products == torch.int8 and not dequant_tiles.native_int8():
            continue
        gemm_dtype(products)
        for amx, quantized in itertools.product((True, False), (True, False)):
            monkeypatch.setattr(setup, "native_amx", lambda amx=amx: amx)
            linear = not amx and (products == torch.int8 or (products == torch.bfloat16 and not quantized))
            assert setup.step_tokens(EngineConfig(), cpu, quantized) == (1024 if linear else 2048)
            assert setup.step_tokens(EngineConfig(), cuda, quantized) == 2048
            assert setup.step_tokens(EngineConfig(max_num_batched_tokens=512), cpu, quantized) == 512


def test_auto_kv_is_bf16_only_for_a_cpu_kv_cache_under_low_precision_products(gemm_dtype):
    """kv_cache_dtype auto: bf16 for a float32 model's K/V cache on CPU when the products run bf16
    or int8; the model's dtype under float32 products, for MLA's latent cache, a hybrid model's
    attention layers and on CUDA."""
    from types import SimpleNamespace

    from pdserve.assembly.build import auto_kv_dtype
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    dense = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    latent = SimpleNamespace(kv_lora_rank=32, qk_rope_head_dim=16, num_attention_heads=4, hidden_size=64)
    for products, want in ((torch.int8, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                           (torch.float32, torch.float32)):
        if products == torch.int8 and not dequant_tiles.native_int8():
            continue
        gemm_dtype(products)
        assert auto_kv_dtype(torch.float32, cpu, dense, False) == want
        assert auto_kv_dtype(torch.float32, cpu, latent, False) == torch.float32
        assert auto_kv_dtype(torch.float32, cpu, dense, True) == torch.float32
        assert auto_kv_dtype(torch.bfloat16, cuda, dense, False) == torch.bfloat16


@needs_int8
@pytest.mark.skipif(not dequant_tiles.native_bf16(), reason="no native bf16 products on this CPU")
def test_amx_cpus_take_int8_up_to_the_crossover_and_bf16_past_it(monkeypatch, gemm_dtype):
    """Under int8 on a CPU with AMX (its presence stood in for where absent): products of up to
    INT8_MAX_ROWS_AMX rows are the int8 kernel's, past them bf16 tiles' (the values of the bf16
    setting), in the compiled kernel and in a layer's product; without AMX int8 at every count."""
    monkeypatch.setattr(dequant_tiles, "INT8_MAX_ROWS_AMX", 40)
    rng = np.random.default_rng(5)
    matrix, codes, scale, minimum = _matrix(rng, 4, 48, 256, 32, True, True)
    layer = quant_cpu.PackedMatrix.of(4, *[torch.from_numpy(a) for a in matrix], 32)
    x = rng.standard_normal((41, 256)).astype(np.float32)
    gemm_dtype(torch.bfloat16)
    bf16, bf16_layer = _run(x, matrix, 4, True, 32), quant_cpu.packed_matmul(torch.from_numpy(x), layer)
    for amx in (True, False):
        monkeypatch.setattr(dequant_tiles, "native_amx", lambda amx=amx: amx)
        gemm_dtype(torch.int8)
        assert dequant_tiles.int8_products(40) and dequant_tiles.int8_products(41) is not amx
        int8 = _int8_reference(x[:40], codes, scale, minimum)
        assert np.abs(_run(x[:40], matrix, 4, True, 32) - int8).max() <= 1e-5 * np.abs(int8).max()
        past = _run(x, matrix, 4, True, 32)
        int8 = _int8_reference(x, codes, scale, minimum)
        assert (np.abs(past - int8).max() <= 1e-5 * np.abs(int8).max()) is not amx
        if amx:
            assert np.array_equal(past, bf16)
            assert torch.equal(quant_cpu.packed_matmul(torch.from_numpy(x), layer), bf16_layer)
