"""A PDSERVE_CACHE_DIR of a test's own (its GGUF views and built-in models apart from the user's)
whose compiled kernels are the user's: the native library is keyed by its source, flags and CPU,
so sharing it is safe, and each process a test starts finds it built instead of compiling it
again (about 5 s of a 2-core machine each)."""
from __future__ import annotations

from pathlib import Path

from pdserve.cache_dir import cache_root


def private_cache_dir(root: Path) -> Path:
    """root/cache, made, with its `native` folder the user's cache's; set PDSERVE_CACHE_DIR to it."""
    shared = cache_root() / "native"
    shared.mkdir(parents=True, exist_ok=True)
    private = root / "cache"
    private.mkdir()
    (private / "native").symlink_to(shared, target_is_directory=True)
    return private
