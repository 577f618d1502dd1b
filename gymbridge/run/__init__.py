"""The run: a GRPO run as a recipe, on top of every other part (``gymbridge train``).

Public API (stable): :class:`RunConfig` (one section per component, defaults defined once) and
:func:`load_run_config` (overlays, ``--set`` overrides, flags); :class:`GRPORun` (``setup()``,
``step()``, ``train()``, ``cleanup()``) and :func:`train` (the whole run on its own event loop);
:class:`StepReport` / :class:`RunSummary` (what a step and a run report); :class:`Callback` and
the default callbacks (console, ``metrics.jsonl``, charts / rollouts / viewer, W&B /
TensorBoard). The modules beside them are the run's parts: :mod:`~gymbridge.run.rundir` (the
run directory), :mod:`~gymbridge.run.placement` (where the generator runs), :mod:`~gymbridge.run.warmup`
(the opt-in format warm-up), :mod:`~gymbridge.run.collect` (``gymbridge collect``).

Invariant: this package imports the others; nothing else imports it (the trainer, the bridge
and the servers never know a run exists). Names here are imported lazily, so
``import gymbridge.run`` pulls neither torch nor an HTTP server.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "ArtifactsCallback": "gymbridge.run.callbacks",
    "Callback": "gymbridge.run.callbacks",
    "ConsoleCallback": "gymbridge.run.callbacks",
    "GRPORun": "gymbridge.run.recipe",
    "MetricsFileCallback": "gymbridge.run.callbacks",
    "ReportersCallback": "gymbridge.run.callbacks",
    "RunConfig": "gymbridge.run.config",
    "RunDir": "gymbridge.run.rundir",
    "RunSummary": "gymbridge.run.report",
    "StepReport": "gymbridge.run.report",
    "default_callbacks": "gymbridge.run.callbacks",
    "load_run_config": "gymbridge.run.config",
    "train": "gymbridge.run.recipe",
}

__all__ = [
    "ArtifactsCallback",
    "Callback",
    "ConsoleCallback",
    "GRPORun",
    "MetricsFileCallback",
    "ReportersCallback",
    "RunConfig",
    "RunDir",
    "RunSummary",
    "StepReport",
    "default_callbacks",
    "load_run_config",
    "train",
]

if TYPE_CHECKING:
    from gymbridge.run.callbacks import (
        ArtifactsCallback,
        Callback,
        ConsoleCallback,
        MetricsFileCallback,
        ReportersCallback,
        default_callbacks,
    )
    from gymbridge.run.config import RunConfig, load_run_config
    from gymbridge.run.recipe import GRPORun, train
    from gymbridge.run.report import RunSummary, StepReport
    from gymbridge.run.rundir import RunDir


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gymbridge.run' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
