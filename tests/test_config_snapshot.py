"""A plain checkpoint's config read back from its snapshot (pdserve.models.config_snapshot) is
transformers' own, attribute for attribute; configs it cannot stand for keep transformers' class."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from transformers import PretrainedConfig

import pdserve
from pdserve.models.builtin import ensure_builtin_model
from pdserve.models.config_snapshot import SnapshotConfig, snapshot_file
from pdserve.models.loader import load_hf_config
from pdserve.testing.model_factory import make_model

# What transformers' config classes define on the class, not per checkpoint: its tensor and
# pipeline parallel plans, the attribute-name map (empty for these models), the per-layer and
# sub-config machinery, rope validation's settings. A snapshot does not carry them, so pdserve
# must never read them (checked below against its source).
CLASS_LEVEL = {"allow_global_per_layer_attribute_access", "attribute_map", "base_config_key",
               "base_model_ep_plan", "base_model_fsdp_plan", "base_model_pp_plan", "base_model_tp_plan",
               "default_rope_type", "default_theta", "extra_config_files", "extra_files",
               "ignore_keys_at_rope_validation", "is_heterogeneous", "per_layer_attributes",
               "per_layer_config", "serialize_explicit_per_layer_config", "sub_configs",
               "sub_configs_defaults", "has_no_defaults_at_init", "is_composition", "model_type"}


def _plain_checkpoints(root: Path) -> list[Path]:
    return [ensure_builtin_model("builtin:tiny"), *(make_model(root, kind) for kind in ("llama", "mistral", "qwen2", "qwen3")),
            make_model(root / "window", "qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1)]


def _public_values(config) -> dict:
    values = {}
    for name in dir(config):
        if name.startswith("_"):
            continue
        try:
            value = getattr(config, name)
        except Exception:  # a property that raises for this config: nothing to compare
            continue
        if not callable(value):
            values[name] = value
    return values


def test_a_snapshot_reads_back_every_attribute_transformers_gives(tmp_path, private_cache):
    for path in _plain_checkpoints(tmp_path):
        full = load_hf_config(path)
        assert isinstance(full, PretrainedConfig) and snapshot_file(path).is_file(), path
        light = load_hf_config(path)
        assert isinstance(light, SnapshotConfig), path
        want = {k: v for k, v in _public_values(full).items() if k not in CLASS_LEVEL or k == "model_type"}
        got = {k: getattr(light, k, "<missing>") for k in want}
        assert got == want, path


def test_pdserve_never_reads_what_a_snapshot_leaves_out():
    root = Path(pdserve.__file__).parent
    source = "\n".join(p.read_text(encoding="utf-8") for p in root.rglob("*.py")
                       if "testing" not in p.parts and p.name != "config_snapshot.py")
    read = sorted(name for name in CLASS_LEVEL - {"model_type"}
                  if re.search(rf"\.{name}\b|[\"']{name}[\"']", source))
    assert read == [], f"pdserve reads config attributes a snapshot does not carry: {read}"


@pytest.mark.parametrize("kind", ["llama-tied-llama3rope", "llama-linear-rope", "gemma3"])
def test_scaled_rope_and_family_configs_keep_transformers_class(tmp_path, private_cache, kind):
    path = make_model(tmp_path, kind)
    for _ in range(2):
        assert isinstance(load_hf_config(path), PretrainedConfig)
    assert not snapshot_file(path).exists()


def test_an_edited_config_is_resolved_again(tmp_path, private_cache):
    path = make_model(tmp_path, "llama")
    load_hf_config(path)
    first = snapshot_file(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    assert snapshot_file(path) != first
    assert isinstance(load_hf_config(path), PretrainedConfig)
    assert load_hf_config(path).rms_norm_eps == 1e-3
