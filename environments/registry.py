"""The registry of example environments: name -> data generator and server class.

Lookups are lazy: listing or generating data never imports the server SDK, and a server
module is imported only when its class is asked for. Every environment package holds
``data.py`` (``make_row(seed, index, **params)`` and ``generate(n, seed, **params)``)
and ``server.py`` (a :class:`gymbridge.server.ResourcesServer` subclass).

Third-party environments register through the ``gymbridge.environments`` entry point group
(:data:`ENTRY_POINT_GROUP`) and appear in :func:`list_envs` / ``gymbridge env list`` after the
built-in ones; a built-in name cannot be taken over.

Invariants: names are unique and equal the package folder name (built-ins); generator parameters
are the keyword-only parameters of ``make_row`` and nothing else (an unknown parameter is
a :class:`~gymbridge.errors.ConfigError` listing the valid ones, never silently ignored).
Each parameter is typed by its annotation (ranges as ``Annotated[int, Field(ge=...)]``);
a value of the wrong type or out of range is a ``ConfigError`` naming the parameter, what it
takes and what it got (strict: ``"3"`` is not an int, ``True`` is not a number), every
problem at once. ``gymbridge env list --params`` shows the types and ranges.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import logging
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

from pydantic import TypeAdapter, ValidationError

from gymbridge.errors import ConfigError

if TYPE_CHECKING:
    from gymbridge.server import ResourcesServer

__all__ = ["ENTRY_POINT_GROUP", "ENVIRONMENTS", "EnvSpec", "get_env", "list_envs"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EnvSpec:
    """One example environment."""

    name: str
    summary: str
    modalities: tuple[str, ...]
    style: Literal["tools", "gymnasium"]
    server_class_name: str
    package_name: str | None = None
    """The package holding ``data.py`` and ``server.py`` (default ``gymbridge_envs.<name>``); a
    third-party environment names its own."""

    @property
    def package(self) -> str:
        return self.package_name or f"gymbridge_envs.{self.name}"

    def data_module(self) -> ModuleType:
        return importlib.import_module(f"{self.package}.data")

    def generator_params(self) -> dict[str, Any]:
        """The generator's parameters and their defaults (``make_row``'s keyword-only parameters)."""
        sig = inspect.signature(self.data_module().make_row)
        return {
            p.name: p.default for p in sig.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY
        }

    def param_types(self) -> dict[str, Any]:
        """Each generator parameter's annotation (``Annotated`` ranges included)."""
        make_row = self.data_module().make_row
        hints = typing.get_type_hints(make_row, include_extras=True)
        return {name: hints.get(name, Any) for name in self.generator_params()}

    def describe_params(self) -> dict[str, str]:
        """A short ``type, range`` text per parameter (what ``env list --params`` prints)."""
        out: dict[str, str] = {}
        for name, hint in self.param_types().items():
            schema = TypeAdapter(hint).json_schema()
            out[name] = _describe(schema)
        return out

    def check_params(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """``params`` validated against the generator's typed parameters; every problem in one error."""
        known = self.generator_params()
        problems = [
            f"{self.name}: unknown generator parameter {k!r} (valid: "
            f"{', '.join(f'{n}={v!r}' for n, v in known.items()) or 'none'})"
            for k in sorted(set(params) - set(known))
        ]
        types = self.param_types()
        checked: dict[str, Any] = {}
        for name, value in params.items():
            if name not in known:
                continue
            try:
                checked[name] = TypeAdapter(types[name]).validate_python(value, strict=True)
            except ValidationError as exc:
                wants = _describe(TypeAdapter(types[name]).json_schema())
                reason = exc.errors()[0]["msg"]
                problems.append(
                    f"{self.name}: generator parameter {name} takes {wants}, got {value!r} ({reason})"
                )
        if problems:
            raise ConfigError(problems, source=f"{self.package}.data")
        return checked

    @property
    def max_turns(self) -> int:
        """Model calls an episode may take (``MAX_TURNS`` of its data module; 1 when it has none)."""
        return int(getattr(self.data_module(), "MAX_TURNS", 1))

    @property
    def smoke_params(self) -> dict[str, Any]:
        """Generator parameters of a smoke run on the tiny model (``SMOKE_PARAMS``; ``{}``: none)."""
        found = getattr(self.data_module(), "SMOKE_PARAMS", None)
        return copy.deepcopy(dict(found)) if isinstance(found, Mapping) else {}

    def make_row(self, seed: int, index: int, **params: Any) -> dict[str, Any]:
        params = self.check_params(params)
        row: dict[str, Any] = self.data_module().make_row(seed, index, **params)
        return row

    def generate(self, n: int, seed: int = 0, **params: Any) -> Iterator[dict[str, Any]]:
        """``n`` rows in the stock Gym row shape; row ``i`` depends only on ``(seed, i, params)``."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        params = self.check_params(params)
        module = self.data_module()
        for index in range(n):
            row: dict[str, Any] = module.make_row(seed, index, **params)
            yield row

    def server_class(self) -> type[ResourcesServer]:
        module = importlib.import_module(f"{self.package}.server")
        cls: type[ResourcesServer] = getattr(module, self.server_class_name)
        return cls

    def make_server(self, **kwargs: Any) -> ResourcesServer:
        return self.server_class()(**kwargs)


_BOUNDS = (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<"))


def _describe(schema: Mapping[str, Any]) -> str:
    """``int, >= 1, <= 12`` / ``'metadata' | 'part'`` / ``string or null`` for a JSON schema."""
    if "enum" in schema:
        return " | ".join(repr(v) for v in schema["enum"])
    if "const" in schema:
        return repr(schema["const"])
    if "anyOf" in schema:
        return " or ".join(_describe(option) for option in schema["anyOf"])
    names = {"integer": "int", "number": "float", "string": "str", "boolean": "bool", "null": "None"}
    text = names.get(str(schema.get("type")), str(schema.get("type", "any")))
    bounds = [f"{op} {schema[key]}" for key, op in _BOUNDS if key in schema]
    return ", ".join([text, *bounds])


ENVIRONMENTS: dict[str, EnvSpec] = {
    spec.name: spec
    for spec in (
        EnvSpec(
            "color_pick",
            "name the colour of a solid image (optionally shown by a look tool)",
            ("image",),
            "tools",
            "ColorPickServer",
        ),
        EnvSpec(
            "side_pick",
            "name the side of the image a bar lies along (one letter)",
            ("image",),
            "tools",
            "SidePickServer",
        ),
        EnvSpec(
            "circle_click", "click the centre of the named circle", ("image",), "tools", "CircleClickServer"
        ),
        EnvSpec(
            "zoom_read",
            "zoom into a large canvas to read a small number",
            ("image",),
            "tools",
            "ZoomReadServer",
        ),
        EnvSpec("beep_count", "count the beeps in a WAV clip", ("audio",), "tools", "BeepCountServer"),
        EnvSpec(
            "bouncing_ball",
            "count a ball's bounces in an MP4 clip",
            ("video",),
            "tools",
            "BouncingBallServer",
        ),
        EnvSpec("counter", "keep a counter through stateful tools", ("text",), "tools", "CounterServer"),
        EnvSpec(
            "grid_door",
            "fetch the key and open the door in a grid world",
            ("image",),
            "gymnasium",
            "GridDoorServer",
        ),
    )
}


ENTRY_POINT_GROUP = "gymbridge.environments"
"""Third-party environments register here: ``[project.entry-points."gymbridge.environments"]
NAME = "package.module:SPEC"``, where ``SPEC`` is an :class:`EnvSpec` (``package_name`` set to
the package holding its ``data.py`` and ``server.py``) or a function returning one."""


def _entry_point_spec(ep: metadata.EntryPoint) -> EnvSpec:
    try:
        found = ep.load()
        spec = found() if callable(found) and not isinstance(found, EnvSpec) else found
    except Exception as exc:  # a broken plug-in is named, not a crash of the whole registry
        raise ConfigError(
            [f"entry point {ep.name} = {ep.value!r}: cannot load: {exc}"], source=ENTRY_POINT_GROUP
        ) from exc
    if not isinstance(spec, EnvSpec):
        raise ConfigError(
            [f"entry point {ep.name} = {ep.value!r}: expected an EnvSpec, got {type(spec).__name__}"],
            source=ENTRY_POINT_GROUP,
        )
    if spec.name != ep.name:
        raise ConfigError(
            [f"entry point {ep.name} = {ep.value!r}: its EnvSpec is named {spec.name!r}"],
            source=ENTRY_POINT_GROUP,
        )
    return spec


def discover_entry_points() -> list[metadata.EntryPoint]:
    """The installed distributions' entry points of :data:`ENTRY_POINT_GROUP`."""
    return list(metadata.entry_points(group=ENTRY_POINT_GROUP))


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in discover_entry_points() if ep.name not in ENVIRONMENTS}


def list_envs() -> list[EnvSpec]:
    """The built-in environments, then the registered third-party ones (a broken one is logged, skipped)."""
    out = list(ENVIRONMENTS.values())
    for ep in _entry_points().values():
        try:
            out.append(_entry_point_spec(ep))
        except ConfigError as exc:
            logger.warning("%s", exc)
    return out


def get_env(name: str) -> EnvSpec:
    """The environment called ``name``; :class:`~gymbridge.errors.ConfigError` when unknown."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    ep = _entry_points().get(name)
    if ep is not None:
        return _entry_point_spec(ep)
    known = [*ENVIRONMENTS, *_entry_points()]
    raise ConfigError([f"unknown environment {name!r}; known: {', '.join(known)}"]) from None
