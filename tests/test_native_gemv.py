"""The compiled quantized matmul of decode steps (pdserve/kernels/native_gemv.c): for each layout
the kernels hold (int4 and int8 values, groups of 16, 32, 64 and 96 columns, with and without mins,
float16 and float32 scales) and for 1 to 40 tokens it gives x @ w.T over the dequantized float32
weights, as numba's kernel does, and the CPU path uses it up to 32 tokens. It is compiled here,
with the machine's compiler."""
from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest
import torch

from pdserve.kernels import dequant_tiles, mxfp4_cpu, native_gemv, numba_fused, quant_cpu, quant_gemv
from pdserve.kernels.native_matrices import fp4_matrix


@pytest.fixture(autouse=True, scope="module")
def private_cache(tmp_path_factory):
    """One private cache for the module: the kernel compiles once here (about 2 s on this
    machine), not once per test."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("native") / "cache"))
        native_gemv.library.cache_clear()
        yield
    native_gemv.library.cache_clear()


def _available() -> bool:
    return native_gemv._why_not() is None and native_gemv.compiler() is not None


needs_native = pytest.mark.skipif(not _available(), reason="neither AVX-512 nor AVX2 or no C compiler: numba's kernel runs")


@pytest.fixture(params=["panels", "tiles"])
def kernel_path(request):
    """Past a token, an AVX2 build's products run native_gemv_panels.c's micro-kernel; the tiles
    it replaced still serve AVX-512 builds (where the panels decline) and the token counts under
    its threshold: both are checked on an AVX2 machine, and on an AVX-512 one through
    test_native_avx2.py's AVX2 build (here the panels would decline: the same run as tiles)."""
    if not _available():
        pytest.skip("no compiled kernel here")
    if request.param == "panels" and not native_gemv.panels_built():
        pytest.skip("this build has no panels (AVX-512): test_native_avx2.py runs them on an AVX2 build")
    before = native_gemv.set_panels_min_tokens(2 if request.param == "panels" else 1 << 30)
    yield request.param
    native_gemv.set_panels_min_tokens(before)


def _matrix(rng, rows, cols, bits, group, has_min, half):
    q = rng.integers(0, 16 if bits == 4 else 256, (rows, cols // 2 if bits == 4 else cols), dtype=np.uint8)
    if bits == 8:
        q = q.view(np.int8)
    else:  # two values a byte: the low nibble column j, the high one column j + 16 of each run of 32
        q = (q & 15) | (rng.integers(0, 16, q.shape, dtype=np.uint8) << 4)
    scales = (rng.random((rows, cols // group)) * 0.02 + 0.001).astype(np.float32)
    mins = (rng.random((rows, cols // group)) * -0.1).astype(np.float32)
    if half:
        scales, mins = (a.astype(np.float16).view(np.uint16) for a in (scales, mins))
    return q, scales, mins if has_min else scales[:, :0]


def _dequantized(q, scales, mins, bits, group, has_min):
    t = lambda a: torch.from_numpy(a.view(np.int16)).view(torch.float16) if a.dtype == np.uint16 else torch.from_numpy(a)  # noqa: E731
    return quant_cpu.dequantize_rows(bits, torch.from_numpy(q), t(scales), t(mins) if has_min else None, group).double()


@needs_native
@pytest.mark.parametrize("bits,group,has_min,half",
                         list(itertools.product((4, 8), (16, 32, 64, 96), (False, True), (False, True))))
def test_matches_the_dequantized_matmul_and_numba(bits, group, has_min, half, kernel_path):
    rng = np.random.default_rng(bits * 1000 + group + 10 * has_min + half)
    rows, cols = 37, 576  # rows not a multiple of the kernel's 4 or 16; columns in groups of 96 too
    q, scales, mins = _matrix(rng, rows, cols, bits, group, has_min, half)
    w = _dequantized(q, scales, mins, bits, group, has_min)
    # every pass: 4 rows x 1 token; 2 x 3, 2 x 8 and 1 x each (one pass, every block decoded once);
    # 13 and 40 (rows decoded once into a buffer, then 8 tokens at a time and the rest)
    for tokens in (1, 3, 8, 13, 40):
        x = rng.standard_normal((tokens, cols)).astype(np.float32)
        got = native_gemv.gemv(x, bits, q, scales, mins, has_min, group)
        assert got is not None
        want = (torch.from_numpy(x).double() @ w.T).numpy()
        scale = np.abs(want).max()
        assert np.abs(got - want).max() <= 1e-5 * scale, tokens
        if bits == 4 and not half:  # numba compiles each signature (about 25 s on a fresh CI machine): one here
            numba_out = quant_gemv.gemv(x, bits, q, scales, mins, has_min, group)
            assert np.abs(got - numba_out).max() <= 1e-5 * scale, tokens


@needs_native
def test_float32_rows_match_the_matmul(kernel_path):
    """Unquantized float32 rows (bits 32), read where they lie: past 8 tokens four rows at a time
    times up to 6 tokens (37 rows: 9 fours and a single; 13 and 40 tokens: passes of 6 and the
    rest), at or under 8 tokens through the pair and single tiles."""
    rng = np.random.default_rng(32)
    w = rng.standard_normal((37, 576)).astype(np.float32)
    q, dummy = w.view(np.uint8), np.zeros(1, np.float32)
    for tokens in (1, 3, 8, 13, 40):
        x = rng.standard_normal((tokens, 576)).astype(np.float32)
        got = native_gemv.gemv(x, 32, q, dummy, dummy, False, 32)
        want = (torch.from_numpy(x).double() @ torch.from_numpy(w).double().T).numpy()
        assert got is not None and np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), tokens


def test_bf16_rows_match_the_matmul(kernel_path):
    """Unquantized bf16 rows (bits 16: a bf16 checkpoint's weights, widened exactly as they are
    read) through the tiles at 1, 3 and 8 tokens and the decoded rows past 8: the product of their
    float32 values, as float32 rows give it."""
    rng = np.random.default_rng(16)
    w = torch.from_numpy(rng.standard_normal((37, 576)).astype(np.float32)).bfloat16()
    q, dummy = w.view(torch.uint8).numpy(), np.zeros(1, np.float32)
    for tokens in (1, 3, 8, 13, 40):
        x = rng.standard_normal((tokens, 576)).astype(np.float32)
        got = native_gemv.gemv(x, native_gemv.BITS_BF16, q, dummy, dummy, False, 32)
        want = (torch.from_numpy(x).double() @ w.double().T).numpy()
        assert got is not None and np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), tokens


@needs_native
@pytest.mark.parametrize("tokens", [13, 40, 130])
def test_bf16_rows_read_in_place_give_the_bf16_products_of_their_values(tokens):
    """Under bf16 products (past 8 tokens), bf16 rows are multiplied where they lie, not copied a
    task: 37 rows (a last task of 5), the sums equal those of the same values held as float32
    rows (copied and rounded a task), bit for bit, and those of bf16 operands in float64."""
    if not dequant_tiles.native_bf16() or dequant_tiles.native_amx():
        pytest.skip("no AVX-512 BF16 here, or AMX tiles (their own path, tests/test_bf16_tiles.py)")
    rng = np.random.default_rng(tokens)
    w = torch.from_numpy(rng.standard_normal((37, 576)).astype(np.float32)).bfloat16()
    x = rng.standard_normal((tokens, 576)).astype(np.float32)
    dummy = np.zeros(1, np.float32)
    dequant_tiles.set_tile_dtype(torch.bfloat16)  # (conftest.py puts it back after the test)
    got = native_gemv.gemv(x, native_gemv.BITS_BF16, w.view(torch.uint8).numpy(), dummy, dummy, False, 32)
    from_float = native_gemv.gemv(x, 32, w.float().numpy(), dummy, dummy, False, 32)
    assert got is not None and np.array_equal(got, from_float)
    exact = (torch.from_numpy(x).bfloat16().double() @ w.double().T).numpy()
    assert np.abs(got - exact).max() <= 1e-5 * np.abs(exact).max()


@needs_native
def test_mxfp4_rows_match_the_dequantized_matmul():
    """gpt-oss's MXFP4 rows as held (two e2m1 codes a byte, the low nibble the even column; an
    E8M0 power of two per 32 columns), through every pass: the one-token path that scales each
    block's dot product, the few-token tiles and the decoded buffer."""
    rng = np.random.default_rng(4)
    rows, cols = 37, 576
    codes = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    scales = rng.integers(120, 132, (rows, cols // 32), dtype=np.uint8)
    w = mxfp4_cpu.dequantize(torch.from_numpy(codes), torch.from_numpy(scales)).double()
    matrix = fp4_matrix(torch.from_numpy(codes), torch.from_numpy(scales))
    for tokens in (1, 3, 8, 13, 40):
        x = rng.standard_normal((tokens, cols)).astype(np.float32)
        got = np.empty((tokens, rows), dtype=np.float32)
        assert native_gemv.run(x.ctypes.data, tokens, cols, matrix, got.ctypes.data)
        want = (torch.from_numpy(x).double() @ w.T).numpy()
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), tokens


@needs_native
def test_rows_too_wide_for_the_decoded_buffer():
    """Past 8192 columns the rows are decoded again for each pass of 8 tokens, not buffered."""
    rng = np.random.default_rng(7)
    q, scales, mins = _matrix(rng, 5, 8192 + 64, 4, 32, True, True)
    w = _dequantized(q, scales, mins, 4, 32, True)
    x = rng.standard_normal((11, 8192 + 64)).astype(np.float32)
    want = (torch.from_numpy(x).double() @ w.T).numpy()
    got = native_gemv.gemv(x, 4, q, scales, mins, True, 32)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@needs_native
def test_decode_sized_matmuls_take_the_compiled_kernel(monkeypatch):
    rng = np.random.default_rng(1)
    q, scales, mins = _matrix(rng, 64, 128, 4, 32, True, True)
    m = quant_cpu.PackedMatrix.of(4, torch.from_numpy(q), torch.from_numpy(scales.view(np.int16)).view(torch.float16),
                                  torch.from_numpy(mins.view(np.int16)).view(torch.float16), 32)
    calls = []
    real = native_gemv.run
    monkeypatch.setattr(native_gemv, "run", lambda *a: calls.append(a[1]) or real(*a))
    x = torch.randn(6 + native_gemv.max_tokens() + 1, 128)
    want = x.double() @ _dequantized(q, scales, mins, 4, 32, True).T
    parts = [quant_cpu.packed_matmul(x[:1], m), quant_cpu.packed_matmul(x[1:6], m)]
    assert calls == [1, 5]
    parts.append(quant_cpu.packed_matmul(x[6:], m))
    assert calls == [1, 5]  # more tokens: dequantized tiles through BLAS
    got = torch.cat(parts).double()
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert list((native_gemv._cache_dir()).glob("native_gemv-*.so"))  # compiled into the cache


@pytest.fixture
def fresh_library():
    native_gemv.library.cache_clear()  # library() reads the switch once
    yield
    native_gemv.library.cache_clear()


def test_switched_off_falls_back_to_numba(monkeypatch, caplog, fresh_library):
    monkeypatch.setenv("PDSERVE_NATIVE_KERNELS", "0")
    with caplog.at_level("INFO", logger=native_gemv.__name__):
        assert native_gemv.library() is None
    assert "PDSERVE_NATIVE_KERNELS=0" in caplog.text
    rng = np.random.default_rng(2)
    # 4 bits, float32 scales and mins: the numba signature test_matches_the_dequantized_matmul_and_numba
    # compiles (each new one costs about 25 s on a fresh CI machine)
    q, scales, mins = _matrix(rng, 20, 64, 4, 32, True, False)
    x = torch.randn(1, 64)
    y = quant_cpu.packed_matmul(x, quant_cpu.PackedMatrix(4, 32, q, scales, mins, True,
                                                          native_gemv.matrix_args(4, q, scales, mins, True, 32)))
    want = x.double() @ _dequantized(q, scales, mins, 4, 32, True).T
    assert (y.double() - want).abs().max() <= 1e-5 * want.abs().max()


@needs_native
@pytest.mark.parametrize("bits,group,has_min,half",
                         list(itertools.product((4, 8), (16, 32, 96), (False, True), (False, True))))
def test_tiles_dequantize_as_numba_bit_for_bit(bits, group, has_min, half):
    """native_tiles.c's tiles (prefill's products) hold the values numba's dequantization gives,
    bit for bit (q * scale, then + min, as transformers rounds them), and their bf16 rounding."""
    rng = np.random.default_rng(bits * 100 + group + 10 * has_min + half)
    rows, cols, start, end = 45, 576, 3, 41
    q, scales, mins = _matrix(rng, rows, cols, bits, group, has_min, half)
    matrix = native_gemv.matrix_args(bits, q, scales, mins, has_min, group)
    reference = _dequantized(q, scales, mins, bits, group, has_min).float()[start:end]
    tile = torch.full((end - start, cols), float("nan"))
    assert native_gemv.dequant_rows(matrix, cols, start, end, tile.data_ptr(), False)
    assert torch.equal(tile, reference)
    if "avx512_bf16" in native_gemv._cpu_flags().split():
        low = torch.zeros(end - start, cols, dtype=torch.bfloat16)
        assert native_gemv.dequant_rows(matrix, cols, start, end, low.data_ptr(), True)
        assert torch.equal(low, reference.to(torch.bfloat16))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_products_take_the_native_tiles_and_agree_with_numbas(dtype, monkeypatch):
    """quant_cpu's many-token product dequantizes through native_tiles.c (its numba fill never
    runs), with the same result as numba's tiles."""
    from pdserve.kernels import dequant_tiles
    if dtype == torch.bfloat16 and not dequant_tiles.native_bf16():
        pytest.skip("no AVX-512 BF16 or AMX on this CPU")
    rng = np.random.default_rng(7)
    q, scales, mins = _matrix(rng, 300, 576, 4, 32, True, True)
    m = quant_cpu.PackedMatrix(4, 32, q, scales, mins, True, native_gemv.matrix_args(4, q, scales, mins, True, 32))
    x = torch.from_numpy(rng.standard_normal((70, 576)).astype(np.float32))
    dequant_tiles.set_tile_dtype(dtype)  # (conftest.py puts it back after the test)
    numba_tiles = quant_cpu._tiled(x, quant_cpu.PackedMatrix(4, 32, q, scales, mins, True, None))
    monkeypatch.setattr(quant_cpu, "_dequantize", None)  # the numba fill would raise if called
    assert torch.equal(quant_cpu._tiled(x, m), numba_tiles)


def test_compiled_norms_sum_in_lanes_under_bf16_products_only():
    """The compiled step's residual add + RMSNorm (pd_add_norm): under bf16 products its sum of
    squares runs in 16 lanes, the Python layers' many-row norm's order (pd_norm_rows), so both
    give the same bits; under float32 products element by element (numba's order), other bits.
    Both within float32 rounding of a float64 norm."""
    lib = native_gemv.library()
    if lib is None or not dequant_tiles.native_bf16():
        pytest.skip("no compiled kernels or no bf16 products on this machine")
    fn = lib.pd_add_norm
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_int, ctypes.c_int,
                   ctypes.c_void_p]
    fn.restype = None
    g = torch.Generator().manual_seed(5)
    rows, cols, eps = numba_fused.PARALLEL_ROWS + 8, 576, 1e-5  # (the many-row norm from PARALLEL_ROWS)
    x, delta = torch.randn(rows, cols, generator=g) * 3, torch.randn(rows, cols, generator=g)
    w = torch.rand(cols, generator=g) + 0.5
    summed64 = x.double() + delta.double()
    ref = w.double() * summed64 * torch.rsqrt(summed64.pow(2).mean(-1, keepdim=True) + eps)

    def compiled() -> torch.Tensor:
        xs, h = x.clone(), torch.empty(rows, cols)
        fn(xs.data_ptr(), delta.data_ptr(), w.data_ptr(), eps, rows, cols, h.data_ptr())
        return h

    dequant_tiles.set_tile_dtype(torch.bfloat16)  # (conftest restores the process's setting)
    lanes = compiled()
    assert torch.equal(lanes, numba_fused.rms_norm(x, w, eps, delta)[1]), "the Python layers' bits"
    dequant_tiles.set_tile_dtype(torch.float32)
    serial = compiled()
    assert not torch.equal(serial, lanes)
    for h in (lanes, serial):
        torch.testing.assert_close(h.double(), ref, atol=1e-5, rtol=1e-5)
