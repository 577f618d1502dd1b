"""``report_to: [wandb, tensorboard]``: the step records of ``metrics.jsonl`` sent to experiment trackers.

Each reporter receives exactly the record :meth:`gymbridge.run.report.StepReport.record` made,
flattened to numeric scalars (``payload.<boundary>.<field>`` for the nested payload bytes;
strings, lists and ``None`` are left out). Both packages are optional extras imported only
when named: a missing one raises :class:`~gymbridge.errors.ConfigError` naming the extra
(``pip install 'gymbridge[wandb]'`` / ``'gymbridge[tensorboard]'``) before any server starts.

Invariant: a reporter never changes the run; ``close`` is safe to call more than once.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

from gymbridge.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["ReportTo", "Reporter", "flat_scalars", "open_reporters"]

ReportTo = Literal["wandb", "tensorboard"]


class Reporter(Protocol):
    def log(self, step: int, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def flat_scalars(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of ``record`` as ``{"a.b": float}`` (bools as 0/1; the rest left out)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat_scalars(value, f"{name}."))
        elif isinstance(value, bool | int | float):
            out[name] = float(value)
    return out


def _require(module: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            [f"report_to: {extra} needs the {extra!r} extra: pip install 'gymbridge[{extra}]' ({exc})"]
        ) from exc


class _Wandb:
    def __init__(self, run_dir: Path, config: Mapping[str, Any]) -> None:
        wandb = _require("wandb", "wandb")
        self._run: Any = wandb.init(
            project="gymbridge", name=run_dir.name, dir=str(run_dir), config=dict(config)
        )

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        self._run.log(flat_scalars(record), step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


class _TensorBoard:
    def __init__(self, run_dir: Path) -> None:
        _require("tensorboard", "tensorboard")
        writer_mod = _require("torch.utils.tensorboard", "tensorboard")
        self._writer: Any = writer_mod.SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        for name, value in flat_scalars(record).items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def open_reporters(names: Sequence[ReportTo], run_dir: Path, config: Mapping[str, Any]) -> list[Reporter]:
    """One reporter per name (each once); :class:`ConfigError` naming the extra of a missing package."""
    reporters: list[Reporter] = []
    for name in dict.fromkeys(names):
        reporters.append(_Wandb(run_dir, config) if name == "wandb" else _TensorBoard(run_dir))
    return reporters
