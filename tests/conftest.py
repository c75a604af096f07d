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
