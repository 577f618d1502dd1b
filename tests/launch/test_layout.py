"""The house: launchers live in gymbridge/launch/ and import the trainer, never the reverse."""

from __future__ import annotations

import ast
from pathlib import Path

import gymbridge

PACKAGE = Path(gymbridge.__file__).resolve().parent


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_the_trainer_never_imports_a_launcher() -> None:
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(m for m in _imports(path) if m.startswith("gymbridge.launch"))
        for path in (PACKAGE / "trainer").glob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_launchers_are_in_launch_and_not_in_the_trainer() -> None:
    launchers = {"smoke.py", "train.py", "collect.py", "rundir.py", "artifacts.py", "placement.py"}
    assert launchers <= {p.name for p in (PACKAGE / "launch").glob("*.py")}
    assert not launchers & {p.name for p in (PACKAGE / "trainer").glob("*.py")}
    assert (PACKAGE / "launch" / "viewer.html").is_file() and (PACKAGE / "configs" / "smoke.yaml").is_file()
