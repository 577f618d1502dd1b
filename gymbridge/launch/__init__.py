"""The launchers: what the ``gymbridge`` CLI runs on top of the library (``smoke``, ``train``, ``collect``).

A launcher starts the servers a run needs on loopback (environment, agent, model server),
places the generator (:mod:`gymbridge.launch.placement`), drives the trainer's loop
(:func:`gymbridge.trainer.train_step`) and writes the run directory
(:mod:`gymbridge.launch.rundir`: ``config.yaml``, ``metrics.jsonl``, ``failures.jsonl``,
checkpoints; :mod:`gymbridge.launch.artifacts`: charts, rollouts, the viewer;
:mod:`gymbridge.launch.reporters`: wandb / tensorboard).

Invariant: the launchers import the trainer, never the reverse; :mod:`gymbridge.trainer` is the
trainer alone. Names here are imported lazily by the submodules that need them, so
``import gymbridge.launch`` pulls neither torch nor an HTTP server.
"""

from __future__ import annotations

from gymbridge.launch.placement import GeneratorConfig
from gymbridge.launch.rundir import RunDir, step_record

__all__ = ["GeneratorConfig", "RunDir", "step_record"]
