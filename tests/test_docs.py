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


SECTIONS = (
    "env",
    "data",
    "model",
    "generator",
    "rollout",
    "bridge",
    "shaping",
    "warmup",
    "trainer",
    "dp",
    "checkpoint",
    "output",
)
DOTTED_KEY = re.compile(rf"^((?:{'|'.join(SECTIONS)})\.[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*)(?=$|[:=\s])")
NOT_A_KEY = re.compile(r"\.(py|md|yaml|sh|json|jsonl)$")
SECTION_SCALAR = re.compile(rf"^({'|'.join(SECTIONS)}): ([^\s{{\[]+)$")
SPAN = re.compile(r"`([^`]+)`")
FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)
OTHER_TOOLS_KEYS = {"env.nemo_gym.config_paths", "env.should_use_nemo_gym"}
"""NeMo-RL's config keys (docs/integrations.md), not ours."""


def _spans(text: str) -> list[str]:
    """The inline code spans of ``text`` (fenced blocks left out: they hold output and other files)."""
    return SPAN.findall(FENCE.sub("", text))


def _sections(text: str) -> list[str]:
    return re.split(r"\n(?=#)", FENCE.sub("", text))


def _field_names() -> set[str]:
    return {key.rsplit(".", 1)[-1] for key in _config_keys()}


def test_regression_every_config_key_in_the_docs_is_a_run_config_key() -> None:
    """The docs named keys the config refuses: ``rollout.max_staleness`` (``bridge.max_staleness``),
    the flat ``checkpoint_every`` / ``dp_workers`` / ``work_dir`` / ``env_params``, ``model: auto``.
    Every backticked dotted key must be a ``RunConfig`` key; an old flat key the config refuses with
    its new name may appear only where it names no field at all (the history of docs/benchmarks.md
    names the launcher it measured "at commit ..."); a section is never a scalar."""
    from gymbridge.run.config import _MOVED

    keys, fields = _config_keys(), _field_names()
    wrong: list[str] = []
    for path in _user_docs():
        for para in path.read_text().split("\n\n"):
            if "at commit" in para:
                continue
            for span in _spans(para):
                where = f"{path.relative_to(REPO)}: `{span}`"
                dotted = DOTTED_KEY.match(span)
                if dotted and not NOT_A_KEY.search(span):
                    key = dotted.group(1)
                    if key not in keys and not key.startswith("env.params.") and key not in OTHER_TOOLS_KEYS:
                        wrong.append(where)
                flat = re.match(r"^([a-z_]+)(?=$|: |=)", span)
                if flat and flat.group(1) in _MOVED and flat.group(1) not in fields:
                    wrong.append(f"{where} (the config's key is {_MOVED[flat.group(1)]})")
                if SECTION_SCALAR.match(span):
                    wrong.append(f"{where} (a section, not a value)")
    assert not wrong, "\n".join(wrong)


def _cli_flags() -> set[str]:
    import argparse

    from gymbridge.cli import build_parser

    flags: set[str] = set()

    def walk(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            flags.update(s for s in action.option_strings if s.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)

    walk(build_parser())
    return flags


FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
REPO_PROGRAM = re.compile(r"((?:benchmarks|scripts|examples|tests)/[\w/]+\.(?:py|sh)|gymbridge(?:\.\w+)+)")
OTHER_PROGRAMS = {"pip", "pytest", "mypy", "ruff", "uv", "gym", "git", "bash"}


def _flags_in(program: str) -> set[str]:
    """The ``--flags`` a repository program's source spells (a script path or a ``gymbridge.*`` module)."""
    path = REPO / (program.replace(".", "/") + ".py" if program.startswith("gymbridge.") else program)
    return set(FLAG.findall(path.read_text())) if path.is_file() else set()


def _program(span: str) -> str | None:
    """``gymbridge``, a repository program, ``other`` (pip, pytest, ...), or ``None`` (no command)."""
    words = span.split()
    while words and (words[0] == "$" or ("=" in words[0] and not words[0].startswith("-"))):
        words.pop(0)  # a prompt, VAR=value
    if not words:
        return None
    if words[0] == "/usr/bin/time":
        return "gymbridge" if any(w.endswith("gymbridge") for w in words) else "other"
    name = words[0].rsplit("/", 1)[-1]
    if name.startswith("python"):
        if words[1:2] == ["-m"] and len(words) > 2:
            return "other" if words[2] in OTHER_PROGRAMS else words[2]
        return words[1] if len(words) > 1 else None
    if name == "gymbridge":
        return "gymbridge"
    return "other" if name in OTHER_PROGRAMS else None


def test_regression_every_flag_in_the_docs_exists() -> None:
    """The docs named ``--work-dir``, a flag no command has. A backticked ``gymbridge`` command line
    takes the CLI's flags; a repository script its own; a bare ``--flag`` either, when its section
    names the script."""
    cli = _cli_flags()
    wrong: list[str] = []
    for path in _user_docs():
        for section in _sections(path.read_text()):
            named = set().union(*(_flags_in(p) for p in REPO_PROGRAM.findall(section)))
            for span in SPAN.findall(section):
                program = _program(span)
                if program == "other":
                    continue
                allowed = cli if program == "gymbridge" else (cli | named | _flags_in(program or ""))
                wrong += [
                    f"{path.relative_to(REPO)}: `{span}`: {f}" for f in FLAG.findall(span) if f not in allowed
                ]
    assert not wrong, "\n".join(wrong)


ERROR_KEY = re.compile(
    rf"(?<![\w.])((?:{'|'.join(SECTIONS)})\.[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*)(?![\w(])"
)
OTHER_TOOLS_ERROR_KEYS = {"rollout.prompt_length"}
"""verl's ``actor_rollout_ref.rollout.prompt_length`` (gymbridge/integrations/verl.py), not ours."""


def _error_texts() -> list[tuple[str, str]]:
    """``(where, text)`` of every string in an error: ``raise`` expressions, ``problems.append(...)``
    (collected into a ``ConfigError``) and everything in gymbridge/errors.py."""
    import ast

    out: list[tuple[str, str]] = []
    for path in sorted((REPO / "gymbridge").rglob("*.py")):
        tree = ast.parse(path.read_text())
        whole = path.name == "errors.py" and path.parent.name == "gymbridge"
        for node in ast.walk(tree):
            is_append = (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "append"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "problems"
            )
            if not (whole or isinstance(node, ast.Raise) or is_append):
                continue
            for leaf in ast.walk(node):
                if isinstance(leaf, ast.Constant) and isinstance(leaf.value, str):
                    out.append((f"{path.relative_to(REPO)}:{getattr(leaf, 'lineno', '?')}", leaf.value))
            if whole:
                break
    return out


def test_regression_every_config_key_an_error_names_exists() -> None:
    """``PolicyDriftError`` told users to look at ``rollout.max_staleness``, a key the config refuses."""
    keys = _config_keys()
    wrong = sorted(
        {
            f"{where}: {key}"
            for where, text in _error_texts()
            for key in ERROR_KEY.findall(text)
            if key not in keys and not key.startswith("env.params.") and key not in OTHER_TOOLS_ERROR_KEYS
        }
    )
    assert not wrong, "\n".join(wrong)
