import os

import pytest
import torch

from pdserve.testing.private_cache import private_cache_dir

# Triton reads TRITON_INTERPRET when it is imported, so this must run before any test module
# imports it: without a GPU the Triton kernels run on the CPU interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """PDSERVE_CACHE_DIR in the test's own directory, sharing the compiled kernels (see
    pdserve.testing.private_cache)."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(private_cache_dir(tmp_path)))


# ---- the suite's time per file, printed at the end of the run (docs/testing.md) -------------
_seconds_per_file: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Setup, call and teardown of each test, summed per file: a module-scoped cluster's start
    lands in its first test's setup and its stop in its last test's teardown."""
    path = report.nodeid.split("::", 1)[0]
    _seconds_per_file[path] = _seconds_per_file.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _seconds_per_file:
        return
    total = sum(_seconds_per_file.values())
    terminalreporter.section("seconds per test file (setup + call + teardown)")
    for path, seconds in sorted(_seconds_per_file.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{seconds:9.1f} s  {100 * seconds / total:5.1f}%  {path}")
    terminalreporter.write_line(f"{total:9.1f} s  in {len(_seconds_per_file)} files")
