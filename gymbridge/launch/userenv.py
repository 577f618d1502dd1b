"""A user's setup for ``gymbridge train``: their environment class, their dataset, their model.

The launcher (:mod:`gymbridge.launch.smoke`) runs the same loop for the example environments
and for a user's setup; this module resolves the three parts a user brings:

* :func:`resolve_env`: ``env: NAME`` (an example environment or one registered in the
  ``gymbridge.environments`` entry-point group) or ``env: module:Class`` (a
  :class:`~gymbridge.server.ResourcesServer` subclass, imported and started by the launcher on
  127.0.0.1 next to our agent and model server);
* :func:`read_dataset`: NeMo Gym rows (``responses_create_params`` + any extra keys), each line
  validated against the wire model before anything starts; a bad line is a
  :class:`~gymbridge.errors.ConfigError` naming the file and line;
* :func:`load_pretrained`: ``model: PATH``, a local Hugging Face model directory, loaded with
  :meth:`~gymbridge.generation.hf.HFGenerator.from_pretrained` (never from a hub) for the
  trainer's policy and, separately, the generator's own copy; :func:`require_vllm` for
  ``backend: vllm`` (GPU only) names the extra when vLLM is missing.

Invariants: ``module:Class`` is imported only because the user named it (the one place a run
executes a user's code, as a plugin would); nothing else read from disk executes code (rows are
JSON, model weights are safetensors through transformers' ``local_files_only`` loading).
"""

from __future__ import annotations

import importlib
import importlib.util
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson

from gymbridge.errors import ConfigError

__all__ = [
    "TINY_MODELS",
    "LauncherModel",
    "UserEnv",
    "is_class_ref",
    "load_pretrained",
    "read_dataset",
    "require_vllm",
    "resolve_env",
]

TINY_MODELS = ("auto", "tiny", "tiny-qwen2-vl", "tiny-qwen2.5-omni")
"""``model:`` values naming the offline tiny models (``tiny`` = ``auto``: by the env's modalities)."""


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

    def data_module(self) -> types.SimpleNamespace:
        """No data generator and no ``format_examples`` (the run needs ``dataset:``; no warm-up)."""
        return types.SimpleNamespace()

    def launcher_defaults(self) -> dict[str, Any]:
        return {}


def resolve_env(env: str) -> Any:
    """``env``'s spec: an example / registered environment by name; a :class:`UserEnv` for ``mod:Class``."""
    if not is_class_ref(env):
        from gymbridge.cli import load_example_environments

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
    return UserEnv(env, cls, modalities)


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


@dataclass(frozen=True)
class LauncherModel:
    """The launcher's model choice: processor and tokenizer, the trainable policy, and its ids."""

    name: str
    processor: Any
    tokenizer: Any
    policy: Any
    placeholder_token_ids: tuple[int, ...]
    policy_factory: Callable[[int], Any]
    """Builds this model's policy from a seed (the in-process generator's own copy)."""
    serve_flag: str | tuple[str, ...]
    """The ``gymbridge model serve`` flag(s) that serve this model (``placement: process``)."""


_PLACEHOLDER_ATTRS = (
    "image_token_id",
    "video_token_id",
    "audio_token_id",
    "image_token_index",
    "video_token_index",
    "audio_token_index",
)


def load_pretrained(path: str, backend: str = "hf") -> LauncherModel:
    """Load the model directory ``path`` (see the module docstring); a bad path is a :class:`ConfigError`."""
    from gymbridge.generation.cli import check_model_dir
    from gymbridge.generation.hf import HFGenerator

    check_model_dir(path)
    loaded = HFGenerator.from_pretrained(path)
    config = loaded.model.config
    ids = {int(v) for a in _PLACEHOLDER_ATTRS if isinstance(v := getattr(config, a, None), int)}

    def build(seed: int) -> Any:  # the weights are the directory's: the seed does not change them
        return HFGenerator.from_pretrained(path).model

    tokenizer = getattr(loaded.processor, "tokenizer", loaded.processor)
    serve = ("--model", str(path), "--backend", backend)
    policy = loaded.model.train()
    return LauncherModel(str(path), loaded.processor, tokenizer, policy, tuple(sorted(ids)), build, serve)


def require_vllm() -> None:
    """``backend: vllm`` needs vLLM (GPU machines): a :class:`ConfigError` naming the extra when absent."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            [
                "backend=vllm needs vLLM, which is not installed: pip install 'gymbridge[vllm]' "
                "(GPU machines only); or use backend=hf"
            ]
        )
