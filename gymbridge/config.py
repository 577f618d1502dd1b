"""Configuration loading: YAML files validated by pydantic models.

One entry point, :func:`load_config`, turns a YAML file (or a mapping) into a
pydantic model. Every validation problem is reported at once in a single
:class:`~gymbridge.errors.ConfigError` (``problems`` lists them with their dotted
path), instead of failing on the first one. Unknown keys are errors: a typo in a
config must never be silently ignored. ``${ENV_VAR}`` and ``${ENV_VAR:-default}``
in string values are expanded from the environment before validation.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from gymbridge.errors import ConfigError

__all__ = ["StrictModel", "expand_env", "load_config", "parse_key_value"]

M = TypeVar("M", bound=BaseModel)

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class StrictModel(BaseModel):
    """Base for config models: unknown keys are rejected, values are validated on assignment."""

    model_config = {"extra": "forbid", "validate_assignment": True}


def expand_env(value: Any, *, problems: list[str] | None = None, path: str = "") -> Any:
    """Expand ``${VAR}`` / ``${VAR:-default}`` in every string of a nested structure.

    A referenced variable that is unset and has no default is a problem (appended
    to ``problems`` when given, else raised as :class:`ConfigError`).
    """
    own = problems is None
    found: list[str] = [] if problems is None else problems

    def sub(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is not None:
            return default
        found.append(f"{path or '<root>'}: environment variable {name} is not set")
        return match.group(0)

    if isinstance(value, str):
        out: Any = _ENV_REF.sub(sub, value)
    elif isinstance(value, Mapping):
        out = {
            k: expand_env(v, problems=found, path=f"{path}.{k}" if path else str(k)) for k, v in value.items()
        }
    elif isinstance(value, list):
        out = [expand_env(v, problems=found, path=f"{path}[{i}]") for i, v in enumerate(value)]
    else:
        out = value
    if own and found:
        raise ConfigError(found)
    return out


def _format_validation_error(err: ValidationError) -> list[str]:
    problems = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        problems.append(f"{loc}: {e['msg']}")
    return problems


def load_config(source: str | Path | Mapping[str, Any], model: type[M]) -> M:
    """Load ``source`` (a YAML path or an already-parsed mapping) into ``model``.

    Raises :class:`ConfigError` listing every problem: unreadable file, invalid
    YAML, unset environment variables, and every pydantic validation error.
    """
    where: str | None = None
    if isinstance(source, (str, Path)):
        where = str(source)
        try:
            text = Path(source).read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError([f"cannot read config file: {e.strerror or e}"], source=where) from e
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError([f"invalid YAML: {e}"], source=where) from e
        if data is None:
            data = {}
    else:
        data = dict(source)
    if not isinstance(data, Mapping):
        raise ConfigError([f"top level must be a mapping, got {type(data).__name__}"], source=where)

    problems: list[str] = []
    data = expand_env(data, problems=problems)
    try:
        cfg = model.model_validate(data)
    except ValidationError as e:
        problems.extend(_format_validation_error(e))
        raise ConfigError(problems, source=where) from e
    if problems:
        raise ConfigError(problems, source=where)
    return cfg


def parse_key_value(text: str) -> tuple[str, Any]:
    """Parse a command-line ``KEY=VALUE`` (keys may be dotted) with a YAML-typed value.

    ``lr=1e-3`` gives ``("lr", 0.001)``, ``name=`` gives ``("name", "")``, and a value
    that is not valid YAML stays the plain string. Meant as an ``argparse`` ``type=``:
    a malformed argument raises ``argparse.ArgumentTypeError`` with a readable message.
    """
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (dotted keys allowed), got {text!r}")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    return key.strip(), parsed
