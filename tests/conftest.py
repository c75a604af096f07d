import os

import pytest
import torch

from pdserve.cache_dir import cache_root

# Triton reads TRITON_INTERPRET when it is imported, so this must run before any test module
# imports it: without a GPU the Triton kernels run on the CPU interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """PDSERVE_CACHE_DIR in the test's own directory (its GGUF views and built-in models apart
    from the user's), whose compiled kernels are the user's: the library is keyed by its source
    and flags, and built there once, not again (5 s) by every worker process a test starts."""
    shared = cache_root() / "native"
    shared.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "native").symlink_to(shared, target_is_directory=True)
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
