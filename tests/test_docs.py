"""The project's docs and docstrings cite only files inside the repository."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = ["gymbridge", "environments", "tests", "docs", "benchmarks", "examples", "scripts"]
OUTSIDE = re.compile(r"DESIGN(\.md)? ?§|DESIGN\.md|/work/|/tmp/nemo_gym_src")
DOC_LINK = re.compile(r"\]\(([^)#:]+\.md)\)")


def _files() -> list[Path]:
    out = [REPO / "README.md"]
    for top in SOURCES:
        out += [p for p in (REPO / top).rglob("*") if p.suffix in {".py", ".md", ".sh", ".yaml"}]
    return [p for p in out if p.is_file() and p.name != "test_docs.py"]


def test_regression_nothing_cites_a_design_document_outside_the_repository() -> None:
    """Docstrings and docs cited "DESIGN §3", a file users never get; the design is docs/design.md."""
    hits = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in _files()
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not hits, "\n".join(hits)


def test_every_docs_link_points_at_a_file_in_the_repository() -> None:
    missing = [
        f"{path.relative_to(REPO)} -> {target}"
        for path in [REPO / "README.md", *(REPO / "docs").glob("*.md")]
        for target in DOC_LINK.findall(path.read_text())
        if not (path.parent / target).is_file()
    ]
    assert not missing, missing
    assert (REPO / "docs" / "design.md").is_file()
