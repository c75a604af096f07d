"""Every import inside a function in pdserve says why it is there.

An import belongs at the top of its module unless it is an optional dependency (ray, nixl,
lmcache, matplotlib, xgrammar, gguf, ...) or a heavy import deferred on purpose (torch kept out
of a torch-free caller, a module chosen by the checkpoint's format, ...). Such an import carries
a `#` comment that says which, on the import statement's own lines or on the line directly
above it. Reads every pdserve/**.py with ast; imports at module level and under
`if TYPE_CHECKING:` are not checked.
"""
from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pdserve"



def function_imports(source: str) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that sits inside a function (at any depth) of the module."""
    found = {}
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    found[id(node)] = node
    return sorted(found.values(), key=lambda node: node.lineno)


def comment_lines(source: str) -> set[int]:
    """The line numbers that hold a `#` comment (found by tokenizing, so a `#` in a string is not one)."""
    return {token.start[0] for token in tokenize.generate_tokens(io.StringIO(source).readline)
            if token.type == tokenize.COMMENT}


def has_comment(comments: set[int], node: ast.Import | ast.ImportFrom) -> bool:
    """A comment on the statement's own lines (lineno..end_lineno) or on the line directly above."""
    return any(line in comments for line in range(node.lineno - 1, node.end_lineno + 1))


def audited_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_the_checker_reads_comments_precisely():
    source = ("def f():\n"
              "    import json  # stdlib, but f is rarely called\n"
              "    # the next one is deferred on purpose\n"
              "    import torch\n"
              "\n"
              "    # too far above\n"
              "    x = 1\n"
              "    import re\n"
              "    s = '#'; import struct\n"
              "    from os import (\n"
              "        path,  # a comment on the statement's own lines counts\n"
              "    )\n"
              "import sys\n")
    comments = comment_lines(source)
    verdicts = {node.lineno: has_comment(comments, node) for node in function_imports(source)}
    assert verdicts == {2: True, 4: True, 8: False, 9: False, 10: True}


def test_every_function_level_import_has_a_comment():
    missing = []
    for path in audited_files():
        source = path.read_text()
        comments = comment_lines(source)
        for node in function_imports(source):
            if not has_comment(comments, node):
                missing.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not missing, ("imports inside functions with no comment saying which optional dependency or "
                         "deferred heavy import they are (hoist them to module level otherwise): "
                         + ", ".join(missing))
