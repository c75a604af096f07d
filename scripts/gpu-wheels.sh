#!/usr/bin/env bash
# The wheels a lent GPU machine lacks (it has torch, Triton and transformers but no network),
# for its Python 3.12, into DIR (default .devwheels, which git ignores through .git/info/exclude
# once this has run). Then, on the device, from the repository root:
#   python3 -m pip install --no-deps --no-index .devwheels/*.whl && export PYTHONPATH=$PWD
#   python3 -m benchmarks.gpu.gpu_suite --out $OUT --steps quant
# (docs/gpu.md). Carry DIR with the run (the device tool's carry list).
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.devwheels}"
mkdir -p "$dir"
case "$dir" in /*) ;; *) grep -qx "/$dir/" .git/info/exclude 2>/dev/null || echo "/$dir/" >> .git/info/exclude ;; esac
get() {
  python3 -m pip download --quiet --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any -d "$dir" "$@"
}
get fastapi uvicorn pydantic  # with their dependencies: pydantic-core must be the one pydantic pins
get --no-deps msgspec pyzmq gguf xgrammar apache-tvm-ffi jsonschema jsonschema-specifications referencing \
  rpds-py compressed-tensors loguru  # their dependencies (torch, transformers, numpy) are there
echo "$(ls "$dir" | wc -l) wheels in $dir ($(du -sh "$dir" | cut -f1))"
