"""Where pdserve keeps what it builds once per machine: the built-in model, GGUF views, the
compiled kernels (PDSERVE_CACHE_DIR, default ~/.cache/pdserve). Imports nothing of pdserve."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))
