"""Models named by Hub id (ORG/NAME) resolve from the local Hugging Face cache without the network,
and what cannot be served is refused before any process starts: an id not cached, a path that
does not exist, a --max-model-len beyond the model's config. Each is one message and exit code 2.

The cache is a fake one in a temporary directory, laid out as huggingface_hub writes it
(models--ORG--NAME/refs/main naming a snapshot under snapshots/)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants

from pdserve.entrypoints.cli import main
from pdserve.models.model_path import ModelLoadError, resolve_model_path

MAIN, OLD = "a" * 40, "b" * 40


def _snapshot(hub: Path, repo: str, commit: str, positions: int) -> Path:
    root = hub / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": positions}))
    return snapshot


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A cache holding acme/tiny at two revisions, refs/main at the newer."""
    hub = tmp_path / "home" / "hub"
    _snapshot(hub, "acme/tiny", OLD, 512)
    newest = _snapshot(hub, "acme/tiny", MAIN, 1024)
    (hub / "models--acme--tiny" / "refs").mkdir()
    (hub / "models--acme--tiny" / "refs" / "main").write_text(MAIN)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))  # what HF_HUB_CACHE / HF_HOME set at import
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub, newest


def test_a_cached_hub_id_resolves_to_its_main_snapshot(hub):
    _, newest = hub
    assert resolve_model_path("acme/tiny") == newest
    with pytest.raises(ModelLoadError, match="holds no snapshot of it: pdserve never downloads"):
        resolve_model_path("acme/absent")
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_path("./acme/tiny")  # a path, not an id: never looked up in the cache


@pytest.mark.parametrize("argv,message", [
    (["serve", "acme/absent"], "'acme/absent' is not a local directory, and the Hugging Face cache"),
    (["up", "--model", "/no/such/dir"], "model directory '/no/such/dir' does not exist"),
    (["serve", "acme/tiny", "--max-model-len", "100000"],
     "--max-model-len 100000 is more than acme/tiny allows: its config.json's max_position_embeddings is 1024"),
    (["up", "--model", "acme/tiny", "--max-model-len", "1025"], "max_position_embeddings is 1024"),
    (["router", "--model", "acme/tiny", "--max-model-len", "2048"], "or add --allow-long-max-model-len to serve 2048"),
])
def test_what_cannot_be_served_is_refused_before_any_process(hub, capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pdserve: error: ") and message in err[0], err


def test_the_cli_exits_2_with_one_line_and_reads_hf_home(hub):
    """The real command: HF_HOME names the cache (its hub/), the id resolves there, and the
    refusal is one line on stderr with exit code 2."""
    home = hub[0].parent
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    cmd = [sys.executable, "-m", "pdserve", "serve", "acme/tiny", "--max-model-len", "2048"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "max_position_embeddings is 1024" in lines[0], lines


def test_revision_picks_a_cached_snapshot_served_under_the_id(hub):
    from pdserve.entrypoints.cli import build_parser
    from pdserve.entrypoints.serve_cli import serve_settings
    hub_dir, newest = hub
    args = serve_settings(build_parser().parse_args(["serve", "acme/tiny", "--revision", "main"]))
    assert args.model == str(newest) and args.served_model_name == ["acme/tiny"]
    older = serve_settings(build_parser().parse_args(["serve", "acme/tiny", "--revision", OLD]))
    assert Path(older.model) == hub_dir / "models--acme--tiny" / "snapshots" / OLD
    with pytest.raises(ValueError, match="max_position_embeddings is 512"):  # the old snapshot's config
        serve_settings(build_parser().parse_args(["serve", "acme/tiny", "--revision", OLD, "--max-model-len", "1000"]))
    with pytest.raises(ValueError, match="at revision 'v9'"):
        serve_settings(build_parser().parse_args(["serve", "acme/tiny", "--revision", "v9"]))


def test_allow_long_max_model_len_passes_the_limit_to_the_router_and_every_node(hub):
    """The override: the start goes on, and `pdserve up` hands --max-model-len with the override to
    the router (its limit) and to each node (whose engine then runs RoPE past the config's
    positions; test_anthropic_messages serves past them end to end)."""
    from pdserve.entrypoints.cli import build_parser
    from pdserve.entrypoints.http_flags import http_flags
    from pdserve.entrypoints.launcher import Cluster
    from pdserve.entrypoints.serve_cli import serve_settings
    args = serve_settings(build_parser().parse_args(["serve", "acme/tiny", "--max-model-len", "4096",
                                                     "--allow-long-max-model-len"]))
    wanted = ["--max-model-len", "4096", "--allow-long-max-model-len"]
    assert http_flags(args)[:3] == wanted
    node = Cluster(args).node_cmd("prefill", "prefill-0", "tcp://127.0.0.1:1", [])
    assert node[node.index("--max-model-len"):][:3] == wanted
    parsed = build_parser().parse_args(["prefill", *node[node.index("prefill") + 1:]])
    assert (parsed.max_model_len, parsed.allow_long_max_model_len) == (4096, True)


def test_an_engine_refuses_a_longer_context_unless_allowed(capsys):
    """A node or `pdserve generate` started by hand: its engine refuses a --max-model-len past the
    config's positions (builtin:tiny's 4096) with the flag that allows it, and runs it with the flag."""
    assert main(["generate", "--model", "builtin:tiny", "--max-model-len", "5000", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "max_model_len 5000 is more than the model's max_position_embeddings 4096" in err
    assert "--allow-long-max-model-len" in err
    assert main(["generate", "--model", "builtin:tiny", "--max-model-len", "5000", "--allow-long-max-model-len",
                 "--max-tokens", "1", "--num-kv-blocks", "8"]) == 0
