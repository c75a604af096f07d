"""The docs, the code and the benchmark scripts speak of the project as it is: no file under
docs/, pdserve/ or benchmarks/, nor the README, names an issue number or the work session that
wrote it."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREES = ("docs", "pdserve", "benchmarks")
TEXT_SUFFIXES = {".py", ".md", ".yml", ".yaml", ".toml", ".json", ".txt", ".sh", ".cfg"}
HISTORY = re.compile(
    r"\bissues? ?#?\d+"                                     # issue 7, issues 6 and 7, issue #3
    r"|\b(?:this|earlier|previous|second|first|last) session\b"
    r"|\bnew in this (?:change|session|round|version)\b",
    re.IGNORECASE)


def checked_files() -> list[Path]:
    files = [ROOT / "README.md"]
    for tree in TREES:
        files += [p for p in (ROOT / tree).rglob("*")
                  if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts]
    return files


def history_mentions(text: str) -> list[str]:
    return [m.group(0) for m in HISTORY.finditer(text)]


def test_the_pattern_catches_history_and_spares_project_words():
    assert history_mentions("Routing (issues 6 and 7), see issue #3; new in this session") == [
        "issues 6", "issue #3", "new in this session"]
    assert history_mentions("The earlier session's numbers") == ["earlier session"]
    assert not history_mentions("multi-round chat, session affinity, round_robin, an issued token")


def test_no_issue_numbers_or_history_in_docs_code_and_benchmarks():
    found = []
    for path in checked_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
            found += [f"{path.relative_to(ROOT)}:{number}: {hit}" for hit in history_mentions(line)]
    assert not found, "say what the project is, not how it got there:\n" + "\n".join(found)
