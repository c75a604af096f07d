"""Print pyproject.toml's dependency declaration alone: the build system, the name, the
dependencies and the named extras (with the extras they name), under a fixed version and
without the readme or tool sections.

The Dockerfile installs the image's dependencies from this, so that its dependency layer stays
cached until they change: a new pytest option, README line or test-only dependency would
otherwise rebuild it (minutes).

    python scripts/dependency-pyproject.py pyproject.toml all > deps/pyproject.toml
"""
import json
import re
import sys

import tomllib


def extras_closure(extras: dict[str, list[str]], name: str, wanted: list[str]) -> set[str]:
    """The extras in `wanted` and those they name through `name[...]`."""
    keep: set[str] = set()
    todo = list(wanted)
    while todo:
        extra = todo.pop()
        if extra in keep:
            continue
        keep.add(extra)
        for req in extras[extra]:
            if (m := re.fullmatch(rf"{re.escape(name)}\[([^\]]*)\]", req.replace(" ", ""))):
                todo += m.group(1).split(",")
    return keep


def main(path: str, *wanted: str) -> None:
    with open(path, "rb") as f:
        declared = tomllib.load(f)
    project, build = declared["project"], declared["build-system"]
    extras = project.get("optional-dependencies", {})
    keep = extras_closure(extras, project["name"], list(wanted))
    q = json.dumps  # a JSON string, or list of strings, is a TOML one
    print("[build-system]", f"requires = {q(build['requires'])}", f"build-backend = {q(build['build-backend'])}",
          "", "[project]", f"name = {q(project['name'])}", 'version = "0"',
          f"requires-python = {q(project.get('requires-python', '>=3'))}",
          f"dependencies = {q(project.get('dependencies', []))}", "", "[project.optional-dependencies]",
          *(f"{q(extra)} = {q(deps)}" for extra, deps in extras.items() if extra in keep), sep="\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
