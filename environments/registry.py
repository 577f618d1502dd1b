"""The registry of example environments: name -> data generator and server class.

Lookups are lazy: listing or generating data never imports the server SDK, and a server
module is imported only when its class is asked for. Every environment package holds
``data.py`` (``make_row(seed, index, **params)`` and ``generate(n, seed, **params)``)
and ``server.py`` (a :class:`gymbridge.server.ResourcesServer` subclass).

Invariants: names are unique and equal the package folder name; generator parameters
are the keyword-only parameters of ``make_row`` and nothing else (an unknown parameter is
a :class:`~gymbridge.errors.ConfigError` listing the valid ones, never silently ignored).
"""

from __future__ import annotations

import copy
import importlib
import inspect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

from gymbridge.errors import ConfigError

if TYPE_CHECKING:
    from gymbridge.server import ResourcesServer

__all__ = ["ENVIRONMENTS", "EnvSpec", "get_env", "list_envs"]


@dataclass(frozen=True)
class EnvSpec:
    """One example environment."""

    name: str
    summary: str
    modalities: tuple[str, ...]
    style: Literal["tools", "gymnasium"]
    server_class_name: str

    @property
    def package(self) -> str:
        return f"environments.{self.name}"

    def data_module(self) -> ModuleType:
        return importlib.import_module(f"{self.package}.data")

    def generator_params(self) -> dict[str, Any]:
        """The generator's parameters and their defaults (``make_row``'s keyword-only parameters)."""
        sig = inspect.signature(self.data_module().make_row)
        return {
            p.name: p.default for p in sig.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY
        }

    def check_params(self, params: Mapping[str, Any]) -> None:
        known = self.generator_params()
        unknown = sorted(set(params) - set(known))
        if unknown:
            valid = ", ".join(f"{k}={v!r}" for k, v in known.items()) or "none"
            raise ConfigError(
                [f"{self.name}: unknown generator parameter {k!r} (valid: {valid})" for k in unknown],
                source=f"environments.{self.name}.data",
            )

    def launcher_defaults(self) -> dict[str, Any]:
        """Launcher settings this environment trains with (``LAUNCHER_DEFAULTS`` of its data module).

        Keys are launcher config keys (``env_params``, ``max_turns``, ``shaping``, ``warmup``, ...);
        a launcher switched to this environment (``--env NAME``) applies them instead of the
        config file's settings for another environment. ``{}`` when the module has none.
        """
        found = getattr(self.data_module(), "LAUNCHER_DEFAULTS", None)
        return copy.deepcopy(dict(found)) if isinstance(found, Mapping) else {}

    def make_row(self, seed: int, index: int, **params: Any) -> dict[str, Any]:
        self.check_params(params)
        row: dict[str, Any] = self.data_module().make_row(seed, index, **params)
        return row

    def generate(self, n: int, seed: int = 0, **params: Any) -> Iterator[dict[str, Any]]:
        """``n`` rows in the stock Gym row shape; row ``i`` depends only on ``(seed, i, params)``."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self.check_params(params)
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


def list_envs() -> list[EnvSpec]:
    return list(ENVIRONMENTS.values())


def get_env(name: str) -> EnvSpec:
    """The environment called ``name``; :class:`~gymbridge.errors.ConfigError` when unknown."""
    try:
        return ENVIRONMENTS[name]
    except KeyError:
        raise ConfigError([f"unknown environment {name!r}; known: {', '.join(ENVIRONMENTS)}"]) from None
