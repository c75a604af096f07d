"""The engine's packages import downward only, counting imports inside functions too: the
engine core imports neither the executor nor speculation (pdserve.assembly joins them), and the
kernels import no model, layer or engine code (a model declares what the compiled decode step
takes: pdserve.kernels.native_decode)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pdserve"

# package -> packages none of its imports may reach
FORBIDDEN = {
    "engine": ("executor", "spec_decode", "assembly", "node", "router", "entrypoints", "cluster"),
    "kernels": ("models", "layers", "engine", "executor", "spec_decode", "assembly"),
    "executor": ("spec_decode", "assembly", "node", "router", "entrypoints"),
    "spec_decode": ("executor", "assembly", "node", "router", "entrypoints"),
    "assembly": ("node", "router", "entrypoints"),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every pdserve import in the file, wherever it stands."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
    return [(line, name) for line, name in found if name.split(".")[0] == "pdserve"]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_runs_back_up(package):
    bad = []
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for line, module in imported_modules(path):
            parts = module.split(".")
            if len(parts) > 1 and parts[1] in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}")
    assert not bad, "\n".join(bad)
