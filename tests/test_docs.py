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


REPO_PATH = re.compile(
    r"`((?:gymbridge|tests|docs|environments|benchmarks|scripts|examples)/[\w./-]*[\w/])(?:::[\w\[\]-]+)?`"
)
SET_KEY = re.compile(r"--set\s+([a-z_][\w.]*)=")


def _user_docs() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_regression_every_repository_path_named_in_the_docs_exists() -> None:
    """The run recipe moved gymbridge/launch/ and tests/trainer/ files; the docs kept naming the old
    paths. A line that dates a number to an older commit ("at commit `e4e3505`") may name what was."""
    missing = [
        f"{path.relative_to(REPO)}:{n}: {target}"
        for path in _user_docs()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "at commit" not in line
        for target in REPO_PATH.findall(line)
        if not (REPO / target.rstrip("/")).exists()
    ]
    assert not missing, "\n".join(missing)


def _config_keys() -> set[str]:
    from gymbridge.run.config import RunConfig

    keys: set[str] = set()

    def walk(model: type, prefix: str) -> None:
        for name, field in model.model_fields.items():  # type: ignore[attr-defined]
            keys.add(prefix + name)
            sub = field.annotation
            if isinstance(sub, type) and hasattr(sub, "model_fields"):
                walk(sub, prefix + name + ".")

    walk(RunConfig, "")
    return keys


def test_regression_every_set_key_in_the_docs_is_a_run_config_key() -> None:
    """The docs showed the old launcher's flat keys (``--set dp_workers=2``, ``--set dedup=false``),
    which the sectioned RunConfig refuses."""
    keys = _config_keys()
    wrong = [
        f"{path.relative_to(REPO)}: --set {key}="
        for path in _user_docs()
        for key in SET_KEY.findall(path.read_text())
        if key not in keys and not key.startswith("env.params.") and key not in {"key", "KEY"}
    ]
    assert not wrong, "\n".join(wrong)
