"""The house: every package has a layer, and no module imports a layer above its own.

:data:`LAYERS` lists gymbridge's packages (and top-level modules) from the bottom up. A module
may import its own package and any package of a lower layer; never a package of the same layer
(siblings stay independent: the trainer never imports the bridge, the server never the client)
and never one above. Every import counts: module-level, inside a function (the lazy imports
that keep torch or aiohttp out until needed), and ``importlib.import_module("gymbridge...")``
with a literal name. A new package fails :func:`test_every_package_has_a_layer` until it is
placed.

``if TYPE_CHECKING:`` imports are annotations only: they never run, so they neither load the
higher layer nor make an import cycle. One may point upward only when it is listed in
:data:`TYPE_ONLY_UPWARD` with the reason; the list is checked both ways (a listed pair that no
longer occurs fails too).

The layers, bottom up: the exception tree; leaf utilities (config loading, limits, fault
injection, safe file I/O, reading a Hugging Face config, ports and the serve loop); what every
command group shares; the wire models; media; trajectories; the model families' rules; tensors
and processing; metrics and the tiny offline models (a product feature: ``smoke run``,
``--model tiny:FAMILY``); the Gym client and the environment SDK; generation; the native
rollout; the bridge, the trainer and the adapters for other trainers; the run recipe; and on
top the ``gymbridge`` command, the test doubles (``gymbridge.testing``, which the library never
imports) and the flat namespace (``gymbridge/__init__.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import gymbridge

PACKAGE = Path(gymbridge.__file__).resolve().parent

LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("config", "faults", "hf_config", "limits", "rowset", "safe_io", "serving"),
    ("cli_common",),
    ("protocol",),
    ("media",),
    ("trajectory",),
    ("families",),
    ("tensors",),
    ("metrics", "models"),
    ("client", "server"),
    ("generation",),
    ("rollout",),
    ("bridge", "integrations", "trainer"),
    ("run",),
    ("__init__", "cli", "testing"),
)
"""gymbridge's packages and top-level modules, the lowest layer first (``__init__``: the package's
own ``__init__.py``, the flat namespace)."""

TYPE_ONLY_UPWARD: dict[tuple[str, str], str] = {
    (
        "families",
        "tensors",
    ): "a family's rules read the PackedTensor media of a batch (built by the tensors)",
}
"""``(importer, imported)`` pairs whose ``if TYPE_CHECKING:`` imports point upward, with the reason."""

LAYER_OF = {unit: depth for depth, layer in enumerate(LAYERS) for unit in layer}


def _unit(parts: tuple[str, ...]) -> str:
    """The layer unit of a module path below ``gymbridge`` (``("tensors", "batch")`` -> tensors)."""
    if not parts:
        return "__init__"
    head = parts[0]
    return head if (PACKAGE / head).is_dir() or (PACKAGE / f"{head}.py").is_file() else "__init__"


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(source: str, rel: tuple[str, ...]) -> list[tuple[str, int, bool]]:
    """``(imported gymbridge unit, line, type-only)`` for every gymbridge import of the module
    ``source`` at ``gymbridge/<rel>.py`` (``rel``: path parts, without the suffix)."""
    package = ("gymbridge", *rel[:-1])  # the package a relative import starts from
    tree = ast.parse(source)
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            type_only.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found: list[tuple[str, int, bool]] = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            names = [f"{base}.{a.name}" for a in node.names] if base == "gymbridge" else [base]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names = [node.args[0].value]
        for name in names:
            parts = tuple(name.split("."))
            if parts[0] == "gymbridge":
                found.append((_unit(parts[1:]), node.lineno, id(node) in type_only))
    return found


def _rel(path: Path) -> tuple[str, ...]:
    return path.relative_to(PACKAGE).with_suffix("").parts


def _unit_of_file(path: Path) -> str:
    """``tensors/batch.py`` -> tensors, ``serving.py`` -> serving, ``__init__.py`` -> __init__."""
    return _rel(path)[0]


def _violations() -> tuple[list[str], set[tuple[str, str]]]:
    """Upward or sideways imports (``path:line: importer (layer) -> imported (layer)``), and the
    type-only upward pairs that :data:`TYPE_ONLY_UPWARD` allows and that occur."""
    bad: list[str] = []
    allowed_seen: set[tuple[str, str]] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = _unit_of_file(path)
        for imported, line, type_only in _imports(path.read_text(encoding="utf-8"), _rel(path)):
            if imported == importer:
                continue
            mine, theirs = LAYER_OF[importer], LAYER_OF[imported]
            if theirs < mine:
                continue
            if type_only and (importer, imported) in TYPE_ONLY_UPWARD:
                allowed_seen.add((importer, imported))
                continue
            where = "the same layer" if theirs == mine else "a higher layer"
            bad.append(
                f"{path.relative_to(PACKAGE)}:{line}: {importer} (layer {mine}) imports {imported} "
                f"({where}, {theirs}){' under TYPE_CHECKING' if type_only else ''}"
            )
    return bad, allowed_seen


def test_every_package_has_a_layer() -> None:
    units = {_unit_of_file(p) for p in PACKAGE.rglob("*.py")}
    assert units - set(LAYER_OF) == set(), "place these in LAYERS"
    assert set(LAYER_OF) - units == set(), "LAYERS names packages that do not exist"
    assert len(LAYER_OF) == sum(len(layer) for layer in LAYERS), "a unit is in two layers"


def test_regression_no_module_imports_a_higher_layer() -> None:
    """The library imported ``gymbridge.testing`` (the tiny models, from generation, the trainer and
    the run), generation imported the bridge (a generator wrapper), media imported the server (port
    helpers), the families imported generation and the tensors (and the tensors the families), and
    the command groups imported the ``gymbridge`` command; this layering forbids all of them."""
    bad, _ = _violations()
    assert bad == [], "\n".join(bad)


def test_type_only_upward_imports_are_exactly_the_listed_ones() -> None:
    _, seen = _violations()
    assert seen == set(TYPE_ONLY_UPWARD), "TYPE_ONLY_UPWARD lists a pair that no longer occurs"


def test_the_layer_check_sees_lazy_relative_and_type_only_imports() -> None:
    """The checker itself: function-level, relative, ``import_module`` and TYPE_CHECKING imports count."""
    source = (
        "import importlib\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from gymbridge.tensors import TrainBatch\n"
        "def f():\n    from gymbridge.run import recipe\n"
        "def g():\n    from ..bridge import iterator\n"
        "def h():\n    return importlib.import_module('gymbridge.trainer')\n"
        "from . import cache\n"
    )
    assert sorted(_imports(source, ("media", "probe")), key=lambda found: found[1]) == [
        ("tensors", 4, True),
        ("run", 6, False),
        ("bridge", 8, False),
        ("trainer", 10, False),
        ("media", 11, False),
    ]


def test_the_tiny_models_are_a_product_package_and_testing_re_exports_them() -> None:
    import gymbridge.models.tiny_families as product_families
    import gymbridge.models.tiny_vlm as product_vlm
    import gymbridge.testing.families as test_families
    import gymbridge.testing.tiny_vlm as test_vlm

    assert test_vlm.build_tiny_vlm is product_vlm.build_tiny_vlm
    assert test_vlm.seeded_model is product_vlm.seeded_model  # a name outside __all__ too
    assert test_families.parse_tiny_spec is product_families.parse_tiny_spec


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
