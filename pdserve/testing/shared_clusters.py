"""`pdserve up` clusters that several test modules share (tests/conftest.py holds the fixtures).

A cluster takes 10-40 s to start and a few seconds to stop on 2 cores, and an idle one still
costs about 7% of a core (pings, the nodes' loops), so a shared cluster starts at the first test
that asks for it and stops right after the last collected test that uses it; the modules that
share one run one after the other (`longest_first`), so it never idles through other modules.

A test uses a shared cluster by naming its fixture, or, where only some parameters of a
parametrized fixture take the shared one (the fixture asks for it with getfixturevalue), by
carrying the mark `shared_cluster(name)` on those parameters: the mark is how the count and the
grouping see a use that the fixture names alone do not show.

Under pytest-xdist (`-n`) each worker runs whole groups (`group_map`, pdserve.testing.xdist_groups):
a module alone, or the modules that share a cluster together, so a module's own clusters and a
shared one start once, on one worker. The groups go out longest first (`longest_first`, by the
seconds per file of tests/file_seconds.json), so the last group to finish is a short one.
"""
from __future__ import annotations

import contextlib
import json
from collections import Counter
from pathlib import Path

from pdserve.testing.up_cluster import running_cluster


class SharedClusters:
    def __init__(self, names: tuple[str, ...]):
        self.names = names  # the fixtures that hand out a shared cluster
        self.users: Counter[str] = Counter()  # fixture -> collected tests still to run that use it
        self._open: dict[str, tuple[str, contextlib.ExitStack]] = {}

    def url(self, name: str, *flags: str, **kwargs) -> str:
        """The cluster `name`, started with these flags (running_cluster's) at the first call."""
        if name not in self._open:
            stack = contextlib.ExitStack()
            url, _ = stack.enter_context(running_cluster(*flags, **kwargs))
            self._open[name] = (url, stack)
        return self._open[name][0]

    def count_users(self, items) -> None:
        self.users = Counter(name for item in items for name in self.names if uses(item, name))

    def finished(self, item) -> None:
        """After a test's teardown: stop the clusters no test left to run uses (running_cluster's
        checks that every process stopped fail this test's teardown)."""
        for name in self.names:
            if uses(item, name):
                self.users[name] -= 1
                if self.users[name] <= 0:
                    self.stop(name)

    def stop(self, name: str) -> None:
        if name in self._open:
            _, stack = self._open.pop(name)
            stack.close()

    def stop_all(self) -> None:
        for name in list(self._open):
            self.stop(name)


def uses(item, name: str) -> bool:
    """Whether the test `item` uses the shared cluster `name` (see the module's docstring)."""
    return name in item.fixturenames or any(name in mark.args for mark in item.iter_markers("shared_cluster"))


def module(item) -> str:
    return item.nodeid.split("::", 1)[0]


def module_groups(items: list, names: tuple[str, ...]) -> dict[str, str]:
    """module -> its group's name, for the modules that use a shared cluster: clusters that one
    module uses together join one group, named by its first cluster."""
    used: dict[str, list[str]] = {}  # module -> the shared clusters it uses, in order of first use
    for item in items:
        for name in names:
            if uses(item, name) and name not in used.setdefault(module(item), []):
                used[module(item)].append(name)
    root = {name: name for name in names}  # cluster -> its group's first cluster (union-find)

    def find(name: str) -> str:
        while root[name] != name:
            name = root[name]
        return name

    for clusters in used.values():
        for other in clusters[1:]:
            root[find(other)] = find(clusters[0])
    return {m: find(clusters[0]) for m, clusters in used.items() if clusters}


def group_of(item, groups: dict[str, str]) -> str:
    """The group of a test under xdist: its module's shared-cluster group, else its module."""
    return groups.get(module(item)) or module(item)


def group_map(items: list, names: tuple[str, ...]) -> dict[str, str]:
    """module -> its group, for every module of the run."""
    groups = module_groups(items, names)
    return {module(item): group_of(item, groups) for item in items}


def file_seconds(path: Path) -> dict[str, float]:
    """The seconds per test file of an earlier run (conftest writes them), or none."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def longest_first(items: list, names: tuple[str, ...], seconds: dict[str, float], default_s: float = 5.0) -> list:
    """The same tests, whole groups at a time (the modules that share a cluster one after the
    other, each module's own order kept), the groups in falling order of their files' seconds (a
    file not listed counts default_s; ties keep the run's order): xdist hands out groups in this
    order, and starting the longest first keeps one worker from finishing a long group alone at
    the end. In one process it still keeps each shared cluster's life to its group's run."""
    groups = module_groups(items, names)
    by_group: dict[str, list] = {}
    for item in items:
        by_group.setdefault(group_of(item, groups), []).append(item)

    def weight(tests: list) -> float:
        return sum(seconds.get(m, default_s) for m in dict.fromkeys(module(t) for t in tests))

    ordered = sorted(by_group.values(), key=weight, reverse=True)  # stable
    return [item for tests in ordered for item in tests]
