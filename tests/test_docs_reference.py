"""docs/configuration.md is what the argparse parsers produce, and `pdserve --version` reports
the package's version."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from pdserve.entrypoints.docs_reference import command_parsers, render

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "configuration.md"


def test_committed_reference_matches_the_parsers():
    assert REFERENCE.read_text() == render(), (
        "docs/configuration.md is out of date: python -m pdserve.entrypoints.docs_reference --write docs/configuration.md")


def test_reference_lists_every_flag_of_every_command():
    text = render()
    for name, parser in command_parsers():
        assert f"## `{name}`" in text
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help", "--version") and action.help != "==SUPPRESS==":
                    assert f"`{flag}`" in text, f"{name} {flag} is missing"


def test_check_mode_fails_on_a_stale_page(tmp_path):
    stale = tmp_path / "configuration.md"
    stale.write_text(render().replace("`--block-size`", "`--blocksize`", 1))
    cmd = [sys.executable, "-m", "pdserve.entrypoints.docs_reference", "--check", str(stale)]
    assert subprocess.run(cmd, capture_output=True).returncode == 1
    stale.write_text(render())
    assert subprocess.run(cmd, capture_output=True).returncode == 0


def test_version_flag_prints_the_pyproject_version():
    want = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    out = subprocess.run([sys.executable, "-m", "pdserve", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"pdserve {want}"
