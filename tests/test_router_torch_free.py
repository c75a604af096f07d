"""The router process loads no torch: it needs only a tokenizer and the block-key function.

Checked twice, each in a fresh interpreter: every router module imported together, and a real
`pdserve router` process on the default model that has served /v1/models, /tokenize (prompt and
chat messages, so the chat template ran) and /detokenize, whose memory maps must hold no torch
library. The router's tokenizer is also checked against AutoTokenizer's on the same files."""
from __future__ import annotations

import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from pdserve.models.gguf import DEFAULT_MODEL
from pdserve.models.model_path import load_tokenizer, resolve_model_path
from pdserve.wire.transport import free_port

IMPORT_EVERY_ROUTER_MODULE = """
import importlib, pkgutil, sys
import pdserve.router as router
names = [m.name for m in pkgutil.walk_packages(router.__path__, "pdserve.router.")]
# and what the router loads only when asked: the registry's Redis client (--registry redis://)
for name in names + ["pdserve.cluster.registry_redis"]:
    importlib.import_module(name)
print(len(names), "torch" in sys.modules)
"""


def test_importing_every_router_module_loads_no_torch():
    out = subprocess.run([sys.executable, "-c", IMPORT_EVERY_ROUTER_MODULE], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    count, torch_loaded = out.stdout.split()
    assert int(count) > 30 and torch_loaded == "False", out.stdout


def test_router_tokenizer_is_autotokenizers():
    from transformers import AutoTokenizer
    path = resolve_model_path(DEFAULT_MODEL)
    ours, reference = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    assert type(ours) is type(reference)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Où est Paris? 🚀"}]
    for text in ("Hello world", "  spaced\ttabs\nand lines  ", "naïve café 東京 🚀"):
        assert ours(text)["input_ids"] == reference(text)["input_ids"]
    assert (ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


def _torch_libraries(pid: int) -> list[str]:
    with open(f"/proc/{pid}/maps") as maps:
        return sorted({line.split()[-1] for line in maps if "libtorch" in line or "/torch/" in line})


@pytest.fixture
def router_process():
    resolve_model_path(DEFAULT_MODEL)  # the GGUF's Hugging Face view, made once (that step uses transformers' config)
    port, dead_node = free_port(), free_port()
    # Its log goes to a file, not a pipe: a pipe nobody reads blocks a router that logs a lot.
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "router", "--model", DEFAULT_MODEL, "--host", "127.0.0.1",
                             "--port", str(port), "--decode", f"tcp://127.0.0.1:{dead_node}"],
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"the router exited:\n{log.read()[-4000:]}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            pytest.fail("the router did not answer /v1/models in 120 s")
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_a_serving_router_process_maps_no_torch(router_process):
    url, pid = router_process
    prompt = httpx.post(f"{url}/tokenize", json={"prompt": "Hello world"}, timeout=30).json()
    chat = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}, timeout=30).json()
    back = httpx.post(f"{url}/detokenize", json={"tokens": prompt["tokens"]}, timeout=30).json()
    assert prompt["count"] == 2 and back["prompt"] == "Hello world"
    assert chat["count"] > prompt["count"]  # the template's role markers were added
    assert _torch_libraries(pid) == []
