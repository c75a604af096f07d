"""numba's kernel cache keyed by the kernels' sources, not their path (pdserve.kernels.numba_cache,
chosen by .ci/run): a second checkout at another path loads the first one's compiles, and a
change to any file of the directory compiles again."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from pdserve.kernels.numba_cache import PackageCacheLocator

LOCATORS = "pdserve.kernels.numba_cache.PackageCacheLocator,numba.core.caching.InTreeCacheLocator"
KERNEL = '''from numba import njit

@njit(cache=True)
def triple(x):
    return 3 * x
'''
HELPER = "SCALE = 1\n"
RUN = ("import json, sys; sys.path.insert(0, sys.argv[1]); from kern.mod import triple; "
       "triple(7); print(json.dumps({'hits': sum(triple.stats.cache_hits.values()), "
       "'misses': sum(triple.stats.cache_misses.values())}))")


def checkout(root: Path, helper: str = HELPER) -> Path:
    (root / "kern").mkdir(parents=True)
    (root / "kern" / "__init__.py").write_text("")
    (root / "kern" / "mod.py").write_text(KERNEL)
    (root / "kern" / "helper.py").write_text(helper)
    return root


def compile_in(root: Path, cache_dir: Path) -> dict:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir), "NUMBA_CACHE_LOCATOR_CLASSES": LOCATORS}
    out = subprocess.run([sys.executable, "-c", RUN, str(root)], capture_output=True, text=True, env=env,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_subpath_follows_the_sources_not_the_path(tmp_path):
    a, b = checkout(tmp_path / "a"), checkout(tmp_path / "b")
    subpath = PackageCacheLocator.get_suitable_cache_subpath
    assert subpath(str(a / "kern" / "mod.py")) == subpath(str(b / "kern" / "mod.py"))
    c = checkout(tmp_path / "c", helper="SCALE = 2\n")  # another file of the directory changed
    assert subpath(str(c / "kern" / "mod.py")) != subpath(str(a / "kern" / "mod.py"))


def test_a_second_checkout_loads_the_first_ones_compile(tmp_path):
    cache = tmp_path / "cache"
    first = compile_in(checkout(tmp_path / "clone-1"), cache)
    assert first == {"hits": 0, "misses": 1}
    shutil.copytree(tmp_path / "clone-1", tmp_path / "clone-2")
    shutil.rmtree(tmp_path / "clone-1")
    assert compile_in(tmp_path / "clone-2", cache) == {"hits": 1, "misses": 0}
    (tmp_path / "clone-2" / "kern" / "helper.py").write_text("SCALE = 2\n")
    assert compile_in(tmp_path / "clone-2", cache) == {"hits": 0, "misses": 1}
