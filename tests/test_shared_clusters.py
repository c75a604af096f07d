"""How conftest decides which tests use a shared cluster (pdserve.testing.shared_clusters): by
the fixture's name, or by the shared_cluster mark on a parameter that asks for it at run time;
the modules that use one run together, and the cluster stops after its last user. Under
pytest-xdist a worker takes a module, or the modules sharing a cluster, whole, the longest first."""
from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pdserve.testing.shared_clusters import SharedClusters, group_map, longest_first, uses


@dataclass
class Item:
    nodeid: str
    fixturenames: list[str] = field(default_factory=list)
    marks: list[pytest.Mark] = field(default_factory=list)

    def iter_markers(self, name: str):
        return (m for m in self.marks if m.name == name)


def _marked(nodeid: str, name: str) -> Item:
    return Item(nodeid, ["cluster"], [pytest.mark.shared_cluster(name).mark])


def test_a_use_is_a_fixture_name_or_a_parameters_mark():
    assert uses(Item("a.py::t", ["plain_cluster"]), "plain_cluster")
    assert uses(_marked("a.py::t[nixl]", "plain_cluster"), "plain_cluster")
    assert not uses(Item("a.py::t[store]", ["cluster"]), "plain_cluster")
    assert not uses(_marked("a.py::t[nixl]", "default_model_cluster"), "plain_cluster")


def test_marked_modules_run_with_the_clusters_other_users():
    items = [Item("a.py::t", ["plain_cluster"]), Item("b.py::t"), Item("c.py::t[store]", ["cluster"]),
             _marked("c.py::t[nixl]", "plain_cluster"), Item("d.py::t", ["plain_cluster"])]
    order = [i.nodeid for i in longest_first(items, ("plain_cluster",), {})]
    assert order == ["a.py::t", "c.py::t[store]", "c.py::t[nixl]", "d.py::t", "b.py::t"]


def test_the_cluster_stops_after_its_last_marked_user(monkeypatch):
    shared = SharedClusters(("plain_cluster",))
    stopped = []
    monkeypatch.setattr(shared, "stop", stopped.append)
    items = [Item("a.py::t", ["plain_cluster"]), _marked("c.py::t[nixl]", "plain_cluster"), Item("c.py::t[store]")]
    shared.count_users(items)
    shared.finished(items[0])
    assert stopped == []
    shared.finished(items[1])
    assert stopped == ["plain_cluster"]


def test_clusters_a_module_uses_together_group_their_modules():
    items = [Item("a.py::t", ["plain_cluster"]), Item("b.py::t"), _marked("c.py::t[nixl]", "plain_cluster"),
             _marked("c.py::t[store]", "store_cluster"), Item("d.py::t"), Item("e.py::t", ["store_cluster"])]
    order = [i.nodeid for i in longest_first(items, ("plain_cluster", "store_cluster"), {})]
    assert order == ["a.py::t", "c.py::t[nixl]", "c.py::t[store]", "e.py::t", "b.py::t", "d.py::t"]


def test_a_worker_takes_a_module_or_a_clusters_users_whole():
    items = [Item("a.py::t", ["plain_cluster"]), Item("b.py::t1"), Item("b.py::t2"),
             _marked("c.py::t[nixl]", "plain_cluster"), Item("c.py::t[store]")]
    assert group_map(items, ("plain_cluster",)) == {"a.py": "plain_cluster", "b.py": "b.py", "c.py": "plain_cluster"}


def test_two_xdist_workers_each_run_whole_modules():
    """The scheduling itself, through pytest and pytest-xdist as installed (xdist's own loadgroup
    split every module across workers under pytest 9.2): each module's tests on one worker."""
    files = ["tests/test_free_port.py", "tests/test_shared_clusters.py", "tests/test_handshake.py"]
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "-v",
                          "-k", "not two_xdist_workers", *files],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent.parent)
    assert run.returncode == 0, run.stdout[-3000:]
    workers: dict[str, set[str]] = {}
    for worker, module in re.findall(r"\[(gw\d+)\] \[\s*\d+%\] PASSED (tests/\S+?\.py)::", run.stdout):
        workers.setdefault(module, set()).add(worker)
    assert set(workers) == set(files), run.stdout[-3000:]
    assert all(len(w) == 1 for w in workers.values()), workers


def test_groups_go_out_longest_first_each_whole():
    items = [Item("a.py::t", ["plain_cluster"]), Item("b.py::t1"), Item("c.py::t"), Item("b.py::t2"),
             Item("d.py::t", ["plain_cluster"]), Item("e.py::t")]
    seconds = {"a.py": 10.0, "b.py": 30.0, "c.py": 1.0, "d.py": 25.0}  # e.py unlisted: 5 s
    order = [i.nodeid for i in longest_first(items, ("plain_cluster",), seconds)]
    assert order == ["a.py::t", "d.py::t", "b.py::t1", "b.py::t2", "e.py::t", "c.py::t"]
