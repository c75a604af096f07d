"""numba's on-disk kernel cache, keyed so that two checkouts of the same kernels share it.

numba's locator for NUMBA_CACHE_DIR files a kernel under a hash of its source directory's
absolute path, so every fresh clone (CI's) compiled every kernel again, and its stamp is the
kernel's own file's contents, so a change to a helper another file inlines left the caller's
cached code stale. PackageCacheLocator files it under the directory's name and a digest of every
.py file in it instead: the same kernels anywhere share entries, and any change to any of them
starts a fresh directory. Chosen through numba's NUMBA_CACHE_LOCATOR_CLASSES (.ci/run sets it):

    NUMBA_CACHE_DIR=~/.cache/pdserve/numba \\
    NUMBA_CACHE_LOCATOR_CLASSES=pdserve.kernels.numba_cache.PackageCacheLocator,numba.core.caching.InTreeCacheLocator
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from numba.core.caching import UserProvidedCacheLocator


@functools.cache
def sources_digest(directory: str) -> str:
    """sha256 over the names and bytes of the directory's .py files, in name order."""
    digest = hashlib.sha256()
    for path in sorted(Path(directory).glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:24]


class PackageCacheLocator(UserProvidedCacheLocator):
    """NUMBA_CACHE_DIR/<directory name>_<sources_digest>: independent of where the tree lies."""

    @classmethod
    def get_suitable_cache_subpath(cls, py_file: str) -> str:
        directory = Path(py_file).resolve().parent
        return f"{directory.name}_{sources_digest(str(directory))}"
