"""The fault soak (benchmarks/soak.py), short: 45 s of traffic and faults on
a 2P2D cluster with a fixed seed, failing on any violation (a request lost, a text that differs
from the offline engine's, a hung request, KV held once idle, RSS past its bound, a process left
behind). Longer runs and their results: docs/reliability.md."""
from __future__ import annotations

import subprocess
import sys

import pytest

MINUTES = 0.75


@pytest.mark.timeout(600)
def test_a_short_soak_finds_no_violation(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.soak", "--minutes", str(MINUTES), "--seed", "7",
                           "--fault-gap-s", "2", "4", "--out", str(out)], capture_output=True, text=True,
                          timeout=540)
    table = proc.stdout[-6000:]
    assert proc.returncode == 0, f"{table}\n{proc.stderr[-3000:]}"
    assert "| lost | 0 |" in proc.stdout and "| text differs | 0 |" in proc.stdout, table
    assert "| fault: kill " in proc.stdout, table  # faults did land
