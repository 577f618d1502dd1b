"""A user's setup for ``gymbridge train``: their environment class and their dataset.

A run (:mod:`gymbridge.run.recipe`) trains the example environments and a user's setup the same
way; this module resolves two parts a user brings (the third, a model directory, is
:mod:`gymbridge.run.model`'s):

* :func:`resolve_env`: ``env: NAME`` (an example environment or one registered in the
  ``gymbridge.environments`` entry-point group) or ``env: module:Class`` (a
  :class:`~gymbridge.server.ResourcesServer` subclass, imported and started by the launcher on
  127.0.0.1 next to our agent and model server);
* :func:`read_dataset`: NeMo Gym rows (``responses_create_params`` + any extra keys), each line
  validated against the wire model before anything starts; a bad line is a
  :class:`~gymbridge.errors.ConfigError` naming the file and line;

Invariants: ``module:Class`` is imported only because the user named it (the one place a run
executes a user's code, as a plugin would); nothing else read from disk executes code (rows are
JSON, model weights are safetensors through transformers' ``local_files_only`` loading).
"""

from __future__ import annotations

import importlib
import importlib.util
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson

from gymbridge.errors import ConfigError

__all__ = ["UserEnv", "is_class_ref", "read_dataset", "resolve_env"]


def is_class_ref(env: str) -> bool:
    """``True`` for ``module:Class`` (a user's server class), ``False`` for an environment name."""
    module, sep, name = env.partition(":")
    return bool(sep and module and name)


@dataclass(frozen=True)
class UserEnv:
    """A user's ``ResourcesServer`` subclass, with the parts of an example env's spec the launcher uses."""

    name: str
    server_class: type[Any]
    modalities: tuple[str, ...] = ("image",)
    """What the model must take; a class may declare ``MODALITIES``; default images (tiny Qwen2-VL)."""

    @property
    def style(self) -> Literal["tools", "gymnasium"]:
        from gymbridge.server import ResourcesServer

        # as ResourcesServer.is_gymnasium: the subclass implements step()
        return "gymnasium" if self.server_class.step is not ResourcesServer.step else "tools"

    def make_server(self, **kwargs: Any) -> Any:
        return self.server_class(**kwargs)

    max_turns: int = 1
    """Model calls per episode when the run does not set ``rollout.max_turns``: the class's
    ``MAX_TURNS``, else 1 (one answer: a tool environment declares one call per tool result it
    wants answered, plus the answer)."""

    def data_module(self) -> types.SimpleNamespace:
        """No data generator and no ``format_examples`` (the run needs ``data.path``; no warm-up)."""
        return types.SimpleNamespace()


def resolve_env(env: str) -> Any:
    """``env``'s spec: an example / registered environment by name; a :class:`UserEnv` for ``mod:Class``."""
    if not is_class_ref(env):
        from gymbridge.cli_common import load_example_environments

        return load_example_environments().get_env(env)
    from gymbridge.server import ResourcesServer

    module_name, _, class_name = env.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            [f"env: cannot import {module_name!r} ({exc}); is it on sys.path / PYTHONPATH?"]
        ) from exc
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, ResourcesServer)):
        what = "not found" if cls is None else f"a {type(cls).__name__}, not a ResourcesServer subclass"
        raise ConfigError([f"env: {env}: {class_name} in {module_name} is {what}"])
    modalities = tuple(getattr(cls, "MODALITIES", ("image",)))
    return UserEnv(env, cls, modalities, int(getattr(cls, "MAX_TURNS", 1)))


def read_dataset(path: str | Path) -> list[bytes]:
    """The rows of the jsonl ``path`` (one JSON object a line), validated; returns each row's line.

    A row is a NeMo Gym dataset row: ``responses_create_params`` (the Responses-API request:
    ``input`` etc.) plus any other keys (kept verbatim). Raises :class:`ConfigError` naming every
    bad line (``rows.jsonl:3: ...``) and for a file without rows.
    """
    from pydantic import ValidationError

    from gymbridge.protocol import RunRequest

    source = Path(path)
    try:
        lines = source.read_bytes().splitlines()
    except OSError as exc:
        raise ConfigError([f"dataset: cannot read {source}: {exc.strerror or exc}"]) from exc
    problems: list[str] = []
    rows: list[bytes] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            problems.append(f"{where}: not JSON: {exc}")
            continue
        if not isinstance(row, dict):
            problems.append(f"{where}: a row must be a JSON object, got {type(row).__name__}")
            continue
        rcp = row.get("responses_create_params")
        if not isinstance(rcp, dict) or "input" not in rcp:
            problems.append(f"{where}: responses_create_params with an input is required (a NeMo Gym row)")
            continue
        try:
            RunRequest.model_validate(row)
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = ".".join(str(p) for p in first["loc"])
            problems.append(f"{where}: {loc}: {first['msg']}")
            continue
        rows.append(line)
        if len(problems) >= 20:
            break
    if problems:
        raise ConfigError(problems)
    if not rows:
        raise ConfigError([f"dataset: {source} holds no rows"])
    return rows
