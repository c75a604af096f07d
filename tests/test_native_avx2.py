"""The compiled kernels' AVX2 build (native_simd.h's pairs of 256-bit registers) on a CPU with
AVX-512, where the other kernel tests run the AVX-512 build: the products' and the compiled
decode step's own tests, run again in a fresh interpreter with PDSERVE_NATIVE_ISA=avx2, against
the same references (the dequantized float64 matmul, numba's kernel, transformers' logits).
On a CPU without AVX-512 those tests already run the AVX2 build, and this one skips."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.kernels import native_gemv
from pdserve.testing.private_cache import private_cache_dir

ROOT = Path(__file__).resolve().parents[1]
# the products at every layout and token count, and a compiled step of every float family (its
# norms, RoPE, paged attention and exp-based activations)
MODULES = ("tests/test_native_gemv.py", "tests/test_native_decode_float.py")


@pytest.mark.skipif("avx512bw" not in native_gemv._cpu_flags().split(), reason="no AVX-512 here: the kernel tests already run the AVX2 build")
@pytest.mark.skipif(native_gemv.compiler() is None, reason="no C compiler")
def test_kernel_tests_pass_on_the_avx2_build(tmp_path):
    # The build goes into the shared compiled kernels (private_cache_dir): a fresh clone's CI
    # reuses the last run's while the kernels are unchanged (this test 85 s -> 38 s, 2026-12-06). Its key
    # holds the flags (-mno-avx512f) and the sources: never the AVX-512 build, nor a stale one.
    env = dict(os.environ, PDSERVE_NATIVE_ISA="avx2", PDSERVE_CACHE_DIR=str(private_cache_dir(tmp_path)))
    env.pop("PYTEST_XDIST_WORKER", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *MODULES],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout.splitlines()[-1], run.stdout[-2000:]


def test_the_avx2_build_hides_avx512_from_the_process(monkeypatch):
    """PDSERVE_NATIVE_ISA=avx2 adds -mno-avx512f to the build, and the CPU's AVX-512 and AMX
    flags are hidden from the bf16 and int8 choices, which the library then lacks; an unknown
    value is refused by name."""
    monkeypatch.setenv("PDSERVE_NATIVE_ISA", "avx2")
    assert native_gemv._flags()[-1] == "-mno-avx512f"
    assert not any(flag.startswith(("avx512", "amx")) for flag in native_gemv._cpu_flags().split())
    monkeypatch.setenv("PDSERVE_NATIVE_ISA", "sse2")
    with pytest.raises(ValueError, match="PDSERVE_NATIVE_ISA='sse2'"):
        native_gemv._flags()
