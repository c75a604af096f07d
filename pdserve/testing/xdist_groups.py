"""The test suite's scheduling under pytest-xdist (`-n`): a worker takes a test's whole group,
a module alone or the modules that share a cluster (pdserve.testing.shared_clusters), so a
module's own clusters and a shared one start once, on one worker, and stop after its last user.

xdist 3.8's own `--dist loadgroup` reads `xdist_group` marks into a suffix of each test's id
(`item._nodeid`), which pytest 9.2's nodes no longer read: every test became a group of its own
and the modules' clusters started on both workers. So the scheduler here is xdist's loadscope
with the scope looked up by module: each worker writes module -> group to GROUPS_FILE_ENV's file
as it collects (conftest), and the controller reads it when it first splits the collection, which
xdist does only once every worker has collected."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

GROUPS_FILE_ENV = "PDSERVE_XDIST_GROUPS_FILE"  # set by the controller, inherited by its workers


def share_groups_file() -> None:
    """In the controller, before its workers start: where they will write the groups."""
    os.environ.setdefault(GROUPS_FILE_ENV, str(Path(tempfile.mkdtemp(prefix="pdserve-xdist-")) / "groups.json"))


def write_groups(groups: dict[str, str]) -> None:
    """In a worker, once collected: module -> group (every worker writes the same; the rename
    makes each write whole)."""
    target = Path(os.environ[GROUPS_FILE_ENV])
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(groups))
    os.replace(tmp, target)


class GroupScheduling(LoadScopeScheduling):
    """loadscope, the scope of a test its module's group; a module not listed is its own."""

    _groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._groups is None:
            self._groups = json.loads(Path(os.environ[GROUPS_FILE_ENV]).read_text())
        module = nodeid.split("::", 1)[0]
        return self._groups.get(module, module)
