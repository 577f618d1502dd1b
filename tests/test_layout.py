"""The house: the run on top, the trainer below it, and the trainer never imports the bridge or the run."""

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


def _offenders(package: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found = {
        str(path.relative_to(PACKAGE)): sorted(m for m in _imports(path) if m.startswith(forbidden))
        for path in (PACKAGE / package).rglob("*.py")
    }
    return {k: v for k, v in found.items() if v}


def test_the_trainer_imports_neither_the_bridge_nor_the_run() -> None:
    assert _offenders("trainer", ("gymbridge.bridge", "gymbridge.run")) == {}


def test_nothing_below_the_run_imports_it() -> None:
    for package in ("bridge", "trainer", "generation", "server", "client", "tensors", "trajectory", "media"):
        assert _offenders(package, ("gymbridge.run",)) == {}, package


def test_the_run_package_holds_the_recipe_and_its_parts() -> None:
    parts = {"config.py", "recipe.py", "report.py", "callbacks.py", "cli.py", "rundir.py", "placement.py"}
    assert parts <= {p.name for p in (PACKAGE / "run").glob("*.py")}
    assert not (PACKAGE / "launch").exists()
    assert (PACKAGE / "run" / "viewer.html").is_file() and (PACKAGE / "configs" / "smoke.yaml").is_file()


def test_every_file_tests_conftest_runs_first_exists() -> None:
    """``HEAVY_FIRST`` (tests/conftest.py) starts the slowest files first under pytest-xdist; a moved
    file left there silently runs last and lengthens CI (the run recipe's move to tests/run/ did)."""
    root = PACKAGE.parent
    tree = ast.parse((root / "tests" / "conftest.py").read_text(encoding="utf-8"))
    (listed,) = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "HEAVY_FIRST" for t in node.targets)
    ]
    assert listed and [p for p in listed if not (root / p).is_file()] == []
