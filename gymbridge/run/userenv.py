"""A user's setup for ``gymbridge train``: their environment class and their dataset.

A run (:mod:`gymbridge.run.recipe`) trains the example environments and a user's setup the same
way; this module resolves two parts a user brings (the third, a model directory, is
:mod:`gymbridge.run.model`'s):

* :func:`resolve_env`: ``env: NAME`` (an example environment or one registered in the
  ``gymbridge.environments`` entry-point group) or ``env: module:Class`` (a
  :class:`~gymbridge.server.ResourcesServer` subclass, imported and started by the launcher on
  127.0.0.1 next to our agent and model server);
* :func:`resolve_mix`: ``env.mix``, several of them in one run (an :class:`EnvMix`: each
  environment's spec under its label, the ``agent_ref`` name of its rows);
* :func:`read_dataset`: NeMo Gym rows (``responses_create_params`` + any extra keys), each line
  validated against the wire model before anything starts, in one streaming pass that also
  gives the file's size, sha256 and row count (:mod:`gymbridge.run.data`); a bad line is a
  :class:`~gymbridge.errors.ConfigError` naming the file and line;

Invariants: ``module:Class`` is imported only because the user named it (the one place a run
executes a user's code, as a plugin would); nothing else read from disk executes code (rows are
JSON, model weights are safetensors through transformers' ``local_files_only`` loading).
"""

from __future__ import annotations

import importlib
import importlib.util
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from gymbridge.errors import ConfigError

if TYPE_CHECKING:
    from gymbridge.run.config import EnvConfig
    from gymbridge.run.data import DatasetFile

__all__ = ["EnvMix", "MixedEnv", "UserEnv", "is_class_ref", "read_dataset", "resolve_env", "resolve_mix"]


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


@dataclass(frozen=True)
class MixedEnv:
    """One environment of an :class:`EnvMix`."""

    label: str
    """The ``agent_ref`` name of its rows (``env.mix[i].label``, or the one derived from its name)."""
    spec: Any
    """Its spec, as :func:`resolve_env` gives it (an example environment's, or a :class:`UserEnv`)."""
    params: dict[str, Any] = field(default_factory=dict)
    """Its data generator's parameters."""
    weight: float = 1.0
    """Its share of the generated rows (of the sum of the mix's weights)."""

    @property
    def has_generator(self) -> bool:
        return not isinstance(self.spec, UserEnv)


@dataclass(frozen=True)
class EnvMix:
    """``env.mix`` resolved: the environments one run trains on, in the config's order.

    It stands where one environment's spec stands: :attr:`modalities` (what the model must take)
    is every environment's, :attr:`max_turns` the most any takes; each environment keeps its own
    style, turns and server (:mod:`gymbridge.run.services` starts one with an agent of its own)."""

    envs: tuple[MixedEnv, ...]

    @property
    def labels(self) -> list[str]:
        return [e.label for e in self.envs]

    @property
    def modalities(self) -> tuple[str, ...]:
        """Every environment's modalities, each once, in order of first appearance."""
        return tuple(dict.fromkeys(m for e in self.envs for m in e.spec.modalities))

    @property
    def max_turns(self) -> int:
        return max(int(e.spec.max_turns) for e in self.envs)

    @property
    def has_generator(self) -> bool:
        """Whether every environment generates rows (a ``module:Class`` one does not)."""
        return all(e.has_generator for e in self.envs)


def resolve_mix(env: EnvConfig) -> EnvMix:
    """``env.mix`` as an :class:`EnvMix` (each name resolved as :func:`resolve_env` does)."""
    return EnvMix(
        tuple(
            MixedEnv(label, resolve_env(entry.name), dict(entry.params), entry.weight)
            for label, entry in zip(env.mix_labels, env.mix, strict=True)
        )
    )


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


def read_dataset(path: str | Path) -> DatasetFile:
    """Validate the jsonl ``path`` (one NeMo Gym row a line) in one streaming pass; returns what it found.

    A row is ``responses_create_params`` (the Responses-API request: ``input`` etc.) plus any other
    keys (kept verbatim); blank lines are skipped. Memory stays bounded by the longest line
    (:class:`~gymbridge.run.data.DatasetReader`). Returns the file's absolute path, size, sha256 and
    row count (``len()``); raises :class:`ConfigError` naming every bad line (``rows.jsonl:3:
    ...``; the first 20, then a count) and for a file without rows.
    """
    from gymbridge.run.data import DatasetReader

    reader = DatasetReader(path)
    for _ in reader:
        pass
    return reader.result()
