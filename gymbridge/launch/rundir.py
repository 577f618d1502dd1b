"""The run directory: one folder per training run that holds everything the run produced.

Layout (``gymbridge smoke run --run-dir DIR``; default ``runs/<env>-<UTC timestamp>/``)::

    DIR/config.yaml       the resolved config (every default filled in); --resume reads it back
    DIR/dataset.jsonl     the rows the run trains on
    DIR/metrics.jsonl     one JSON object per step, written by :func:`step_record` only
    DIR/failures.jsonl    one JSON object per failed rollout / group (always present, empty if none)
    DIR/checkpoints/      run checkpoints (see :mod:`gymbridge.trainer.checkpoint`)

Invariants:

* a run directory is never deleted by the run that made it (it outlives the process);
* ``metrics.jsonl`` holds one line per step; a step's line is appended (and flushed) once the
  step is done, before the step's checkpoint is written, so after a crash every checkpointed
  step has its line. :meth:`RunDir.rewind` (``--resume``) drops the lines of steps after the
  checkpoint and a torn last line, so each step number appears once in a resumed run;
* ``failures.jsonl`` is rewound the same way: only the records of rows the checkpoint counts as
  done stay (a row in flight at the crash runs again and records its failures again);
* every rewrite is atomic (:func:`gymbridge.safe_io.write_atomic`).
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import yaml

from gymbridge.errors import ConfigError
from gymbridge.safe_io import write_atomic

if TYPE_CHECKING:
    from gymbridge.bridge import GroupResult
    from gymbridge.metrics import BoundaryTotals
    from gymbridge.trainer.grpo import StepMetrics

logger = logging.getLogger(__name__)

__all__ = ["RunDir", "default_run_dir", "payload_delta", "step_record"]

RUNS_ROOT = Path("runs")


def default_run_dir(env: str, *, root: Path = RUNS_ROOT, now: dt.datetime | None = None) -> Path:
    """``<root>/<env>-<UTC timestamp>`` (``-2``, ``-3``, ... appended if that already exists)."""
    stamp = (now or dt.datetime.now(dt.UTC)).strftime("%Y%m%dT%H%M%SZ")
    base = root / f"{env}-{stamp}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def _json_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON-object lines of ``path``; a line that does not parse (torn by a crash) is skipped."""
    if not path.is_file():
        return []
    out: list[dict[str, Any]] = []
    for lineno, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError:
            logger.warning("%s:%d: not JSON (torn by a crash?); dropped", path, lineno)
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


@dataclass(frozen=True)
class RunDir:
    """Paths of one run directory; :meth:`create` makes it (idempotent)."""

    path: Path

    @property
    def config_path(self) -> Path:
        return self.path / "config.yaml"

    @property
    def dataset_path(self) -> Path:
        return self.path / "dataset.jsonl"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def failures_path(self) -> Path:
        return self.path / "failures.jsonl"

    @property
    def checkpoints_path(self) -> Path:
        return self.path / "checkpoints"

    @classmethod
    def create(cls, path: str | Path) -> RunDir:
        """Make ``path`` with ``checkpoints/`` and an (empty) ``failures.jsonl``; keep what exists."""
        run = cls(Path(path))
        try:
            run.checkpoints_path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError([f"run_dir: cannot create {run.path}: {exc.strerror or exc}"]) from exc
        run.failures_path.touch(exist_ok=True)
        return run

    # ------------------------------------------------------------------ config
    def write_config(self, data: Mapping[str, Any]) -> None:
        text = yaml.safe_dump(dict(data), sort_keys=False, allow_unicode=True)
        write_atomic(self.config_path, [text.encode()])

    def read_config(self) -> dict[str, Any]:
        """The saved config as a mapping (:class:`ConfigError` naming the file if it is missing or bad)."""
        where = str(self.config_path)
        try:
            data = yaml.safe_load(self.config_path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError([f"not a run directory: {exc.strerror or exc}"], source=where) from exc
        except yaml.YAMLError as exc:
            raise ConfigError([f"invalid YAML: {exc}"], source=where) from exc
        if not isinstance(data, dict):
            raise ConfigError(["top level must be a mapping"], source=where)
        return data

    # ------------------------------------------------------------------ metrics
    def append_metrics(self, record: Mapping[str, Any]) -> None:
        """Append one step's record (a whole line in one write, flushed)."""
        with self.metrics_path.open("ab") as f:
            f.write(orjson.dumps(record, default=str, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
            f.flush()

    def metrics(self) -> list[dict[str, Any]]:
        return _json_lines(self.metrics_path)

    def failures(self) -> list[dict[str, Any]]:
        return _json_lines(self.failures_path)

    def rewind(self, *, last_step: int, done_task_indices: Iterable[int]) -> None:
        """Forget what happened after a checkpoint: metrics of later steps, failures of rows not done."""
        done = set(done_task_indices)
        kept = [r for r in self.metrics() if isinstance(r.get("step"), int) and r["step"] <= last_step]
        write_atomic(self.metrics_path, [orjson.dumps(r) + b"\n" for r in kept])
        failures = [r for r in self.failures() if r.get("task_index") in done]
        write_atomic(self.failures_path, [orjson.dumps(r) + b"\n" for r in failures])


def payload_delta(
    before: Mapping[str, BoundaryTotals], after: Mapping[str, BoundaryTotals]
) -> dict[str, dict[str, int]]:
    """Bytes recorded per boundary between two :meth:`~gymbridge.metrics.PayloadMeter.report` s."""
    out: dict[str, dict[str, int]] = {}
    for name, t in after.items():
        b = before.get(name)
        out[name] = {
            "serialized_bytes": t.serialized_bytes - (b.serialized_bytes if b else 0),
            "physical_media_bytes": t.physical_media_bytes - (b.physical_media_bytes if b else 0),
            "logical_media_bytes": t.logical_media_bytes - (b.logical_media_bytes if b else 0),
        }
    return out


def step_record(
    step: int,
    metrics: StepMetrics,
    *,
    groups: list[GroupResult],
    dropped_stale: list[GroupResult],
    policy_version: int,
    dropped_zero_variance: Sequence[GroupResult] = (),
    rollouts_ok: int,
    rollouts_failed: int,
    weight_sync_s: float,
    step_s: float,
    payload: Mapping[str, Mapping[str, int]],
    **extra: Any,
) -> dict[str, Any]:
    """The one ``metrics.jsonl`` record of a step: ``StepMetrics.as_dict()`` plus the launcher's keys.

    Every field of :class:`~gymbridge.trainer.grpo.StepMetrics` appears as is; ``task_indices``
    are the dataset rows trained in this step (batch order), ``media_keys`` the content keys
    of the media in the trained batch (sorted, each once), ``groups_zero_variance_dropped`` /
    ``zero_variance_task_indices`` the groups dynamic sampling left out of it (each also in
    ``failures.jsonl``, class ``zero_variance``), ``staleness_max`` the largest
    ``policy version - oldest turn version`` among them, ``payload`` the bytes each boundary
    recorded since the previous step's record.
    """
    keys: set[str] = set()
    for g in groups:
        for traj in g.trajectories:
            for turn in traj.turns:
                keys.update(m.key for m in turn.media)
    record: dict[str, Any] = {"step": step}
    record.update(metrics.as_dict())
    record.update(
        {
            "policy_version": policy_version,
            "env_reward_mean": extra.pop("env_reward_mean", None),
            "staleness_max": max((g.staleness for g in groups), default=0),
            "rollouts_ok": rollouts_ok,
            "rollouts_failed": rollouts_failed,
            "groups_dropped_stale": len(dropped_stale),
            "groups_zero_variance_dropped": len(dropped_zero_variance),
            "zero_variance_task_indices": [g.task_index for g in dropped_zero_variance],
            "task_indices": [g.task_index for g in groups],
            "media_keys": sorted(keys),
            "weight_sync_s": weight_sync_s,
            "step_s": step_s,
            "payload": {k: dict(v) for k, v in payload.items()},
            **extra,
        }
    )
    return record
