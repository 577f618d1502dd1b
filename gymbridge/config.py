"""Configuration loading: YAML files, OmegaConf interpolation and overrides, pydantic validation.

One entry point, :func:`load_config`, turns a YAML file (or a mapping) plus ``KEY=VALUE``
overrides into a pydantic model, in three stages:

1. read: ``yaml.safe_load`` (nothing in a file executes code), then ``OmegaConf.create``;
2. merge: overrides are OmegaConf dot-lists (``trainer.lr=1e-3``, values YAML-typed), merged
   over the file (:func:`merge_overrides`), as NeMo Gym, NeMo-RL and verl take them;
3. resolve + validate: OmegaConf interpolation (``${trainer.lr}`` refers to another key,
   ``${oc.env:VAR}`` / ``${oc.env:VAR,default}`` to the environment; a literal ``${`` is written
   ``\\${``) through ``OmegaConf.to_container(resolve=True)``, then the pydantic model.

Invariants: every problem is reported at once in one :class:`~gymbridge.errors.ConfigError`
(``problems`` lists them, each naming its dotted key: an interpolation that does not resolve, an
unset environment variable, every pydantic error), instead of failing on the first one; unknown
keys are errors (a typo in a config is never silently ignored); interpolation is resolved after
the overrides are merged, so ``${...}`` sees the values a run actually uses.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ValidationError

from gymbridge.errors import ConfigError

__all__ = [
    "StrictModel",
    "load_config",
    "merge_overrides",
    "parse_key_value",
    "parse_override",
    "read_config",
    "validate_config",
    "validate_plain",
]

M = TypeVar("M", bound=BaseModel)


class StrictModel(BaseModel):
    """Base for config models: unknown keys are rejected, values are validated on assignment."""

    model_config = {"extra": "forbid", "validate_assignment": True}


ENV_HINT = " (an environment variable is written ${oc.env:NAME} or ${oc.env:NAME,default})"


def _omegaconf_message(exc: OmegaConfBaseException) -> str:
    # OmegaConf appends "full_key: ..., object_type=..." lines; the first line is the reason
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith(("Unsupported interpolation type", "Interpolation key")):
        text += ENV_HINT  # most likely the ${VAR} / ${VAR:-default} shell syntax
    return text


def read_config(source: str | Path | Mapping[str, Any]) -> DictConfig:
    """Read a YAML file (or take a mapping) as an unresolved ``DictConfig``; interpolations stay as written.

    Raises :class:`ConfigError` for an unreadable file, invalid YAML, a top level that is not a
    mapping, or a value OmegaConf cannot hold.
    """
    where: str | None = None
    if isinstance(source, (str, Path)):
        where = str(source)
        try:
            text = Path(source).read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError([f"cannot read config file: {e.strerror or e}"], source=where) from e
        try:
            data: Any = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError([f"invalid YAML: {e}"], source=where) from e
        if data is None:
            data = {}
    else:
        data = dict(source)
    if not isinstance(data, Mapping):
        raise ConfigError([f"top level must be a mapping, got {type(data).__name__}"], source=where)
    try:
        return OmegaConf.create(dict(data))
    except OmegaConfBaseException as e:
        raise ConfigError([_omegaconf_message(e)], source=where) from e


def parse_override(text: str) -> str:
    """Check a command-line ``KEY=VALUE`` override (dotted keys allowed) and return it unchanged.

    Meant as an ``argparse`` ``type=``: a malformed argument raises ``argparse.ArgumentTypeError``
    with a readable message. The value is typed when it is merged (:func:`merge_overrides`).
    """
    key, sep, _ = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (dotted keys allowed), got {text!r}")
    return text


def merge_overrides(
    conf: DictConfig, overrides: Sequence[str | tuple[str, Any]], *, where: str | None = None
) -> DictConfig:
    """``conf`` with the ``KEY=VALUE`` dot-list ``overrides`` merged over it (OmegaConf, YAML-typed values).

    A value that is not valid YAML stays the plain string; a ``(key, value)`` pair (from code) sets
    the already-typed value at the dotted key. A malformed override is a :class:`ConfigError`
    naming it.
    """
    problems: list[str] = []
    out = conf
    for item in overrides:
        text = item if isinstance(item, str) else f"{item[0]}={item[1]!r}"
        key = text.partition("=")[0].strip()
        try:
            if isinstance(item, str):
                parse_override(item)
                out = OmegaConf.merge(out, OmegaConf.from_dotlist([_dotlist_entry(item)]))  # type: ignore[assignment]
            else:
                out = out.copy()
                OmegaConf.update(out, item[0], item[1], merge=True)
        except (OmegaConfBaseException, argparse.ArgumentTypeError) as e:
            reason = _omegaconf_message(e) if isinstance(e, OmegaConfBaseException) else str(e)
            problems.append(f"{key or text}: bad override {text!r}: {reason}")
    if problems:
        raise ConfigError(problems, source=where)
    return out


def _dotlist_entry(text: str) -> str:
    """``KEY=VALUE`` as OmegaConf's dot-list reads it: the key stripped, an empty VALUE the empty
    string (not null), a VALUE that is not YAML (``colour=[unclosed``) the plain text."""
    key, _, value = text.partition("=")
    try:
        yaml.safe_load(value)
        parsable = bool(value.strip())
    except yaml.YAMLError:
        parsable = False
    return f"{key.strip()}={value}" if parsable else f"{key.strip()}='{value.replace(chr(39), chr(39) * 2)}'"


def _resolve_all(node: Any, path: str, problems: list[str]) -> Any:
    """``OmegaConf.to_container(resolve=True)`` that keeps going: each key that fails is a problem."""
    if isinstance(node, DictConfig):
        out: dict[str, Any] = {}
        for key in node:
            where = f"{path}.{key!s}" if path else str(key)
            try:
                value = node[key]
            except OmegaConfBaseException as e:
                problems.append(f"{where}: {_omegaconf_message(e)}")
                continue
            out[str(key)] = _resolve_all(value, where, problems)
        return out
    if isinstance(node, ListConfig):
        items: list[Any] = []
        for i in range(len(node)):
            try:
                value = node[i]
            except OmegaConfBaseException as e:
                problems.append(f"{path}[{i}]: {_omegaconf_message(e)}")
                continue
            items.append(_resolve_all(value, f"{path}[{i}]", problems))
        return items
    return node


def _format_validation_error(err: ValidationError, skip: set[str]) -> list[str]:
    problems = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        if loc in skip and e["type"] == "missing":
            continue  # already reported: its interpolation did not resolve
        problems.append(f"{loc}: {e['msg']}")
    return problems


def validate_config(conf: DictConfig, model: type[M], *, where: str | None = None) -> M:
    """Resolve ``conf``'s interpolations and validate the plain result with ``model``.

    Raises :class:`ConfigError` listing every problem (each unresolvable key, every pydantic error).
    """
    problems: list[str] = []
    try:
        data = OmegaConf.to_container(conf, resolve=True)
    except OmegaConfBaseException:
        data = _resolve_all(conf, "", problems)  # the slow path, to name every failing key
    return validate_plain(data, model, where=where, problems=problems)


def validate_plain(data: Any, model: type[M], *, where: str | None = None, problems: Sequence[str] = ()) -> M:
    """Validate already-resolved ``data`` with ``model`` (no interpolation: a saved, resolved config).

    Raises :class:`ConfigError` listing ``problems`` plus every pydantic error.
    """
    problems = list(problems)
    failed = {p.partition(":")[0] for p in problems}
    try:
        cfg = model.model_validate(data)
    except ValidationError as e:
        problems.extend(_format_validation_error(e, failed))
        raise ConfigError(problems, source=where) from e
    if problems:
        raise ConfigError(problems, source=where)
    return cfg


def load_config(
    source: str | Path | Mapping[str, Any], model: type[M], *, overrides: Sequence[str] = ()
) -> M:
    """Load ``source`` (a YAML path or an already-parsed mapping) with ``overrides`` into ``model``.

    Raises :class:`ConfigError` listing every problem: unreadable file, invalid YAML, a malformed
    override, an interpolation or environment variable that does not resolve, and every pydantic
    validation error.
    """
    where = str(source) if isinstance(source, (str, Path)) else None
    conf = merge_overrides(read_config(source), overrides, where=where)
    return validate_config(conf, model, where=where)


def parse_key_value(text: str) -> tuple[str, Any]:
    """Parse a command-line ``KEY=VALUE`` with a YAML-typed value (``gymbridge env data --param``).

    ``lr=1e-3`` gives ``("lr", 0.001)``, ``name=`` gives ``("name", "")``, and a value that is not
    valid YAML stays the plain string. Meant as an ``argparse`` ``type=``: a malformed argument
    raises ``argparse.ArgumentTypeError`` with a readable message.
    """
    key = parse_override(text).partition("=")[0]
    value = text.partition("=")[2]
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    return key.strip(), parsed
