"""`pdserve up` clusters that several test modules share (tests/conftest.py holds the fixtures).

A cluster takes 10-40 s to start and a few seconds to stop on 2 cores, and an idle one still
costs about 7% of a core (pings, the nodes' loops), so a shared cluster starts at the first test
that asks for it and stops right after the last collected test that uses it; the modules that
share one run one after the other (`group_modules`), so it never idles through other modules.

A test uses a shared cluster by naming its fixture, or, where only some parameters of a
parametrized fixture take the shared one (the fixture asks for it with getfixturevalue), by
carrying the mark `shared_cluster(name)` on those parameters: the mark is how the count and the
grouping see a use that the fixture names alone do not show.
"""
from __future__ import annotations

import contextlib
from collections import Counter

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


def group_modules(items: list, names: tuple[str, ...]) -> list:
    """The same tests, with the modules that share a cluster moved up to run right after the
    first of them (each module's own order kept, and the rest of the run's). Clusters that one
    module uses together form one group, so each of them lives only through that group."""
    def module(item) -> str:
        return item.nodeid.split("::", 1)[0]

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
    group = {m: find(clusters[0]) for m, clusters in used.items() if clusters}
    ordered, placed = [], set()
    for item in items:
        name = group.get(module(item))
        if name is None:
            ordered.append(item)
        elif name not in placed:
            placed.add(name)
            ordered.extend(i for i in items if group.get(module(i)) == name)
    return ordered
