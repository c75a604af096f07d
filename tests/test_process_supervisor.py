"""`pdserve up`'s process supervisor stops what it started: a process that ignores SIGTERM is
killed once the stop deadline passes, and reaped before stop_processes returns, so no node
outlives its launcher (one CI run found a decode node still running after `pdserve up` exited)."""
from __future__ import annotations

import os
import signal
import sys
import time

from pdserve.entrypoints import processes
from pdserve.entrypoints.processes import ProcessSupervisor

# Ignores SIGTERM, then says it is ready by creating the file named by its argument.
IGNORES_SIGTERM = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "open(sys.argv[1], 'w').close(); time.sleep(120)")


def test_a_process_that_ignores_sigterm_is_killed_and_reaped(monkeypatch, tmp_path):
    monkeypatch.setattr(processes, "STOP_DEADLINE_S", 0.5)
    ready = tmp_path / "ready"
    supervisor = ProcessSupervisor()
    supervisor.launch("stubborn", [sys.executable, "-c", IGNORES_SIGTERM, str(ready)], dict(os.environ))
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    (_, proc), = supervisor.procs
    supervisor.stop_processes()
    assert proc.returncode == -signal.SIGKILL  # reaped here, not left to whoever inherits it
