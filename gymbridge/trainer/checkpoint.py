"""Run checkpoints: everything a killed run needs to continue as if it had not stopped.

A checkpoint of step ``s`` (``DIR/checkpoints/``) is

* ``step-<s>.ckpt``: one :func:`gymbridge.safe_io.save_state` file (safetensors + JSON + sha256)
  with the policy weights (``model.<name>``), the optimizer's tensors (``optim.<param>.<key>``)
  and the torch RNG state (``rng.torch``) as tensors, and with ``kl_coef > 0`` the frozen
  reference policy (``reference.<name>``: the run's initial weights, which a resumed run
  must score its KL against, not its checkpoint's); the JSON part holds the step count, the
  policy version, the optimizer's scalar state and param groups, the Python and NumPy RNG
  states and the iterator's position: the dataset rows whose group was consumed
  (``done_task_indices``: trained, failed or dropped). Groups in flight at the checkpoint
  are not in it, so a resumed run starts them again and trains each row once;
* ``latest.json``: ``{"step", "state"}``, written **last** and atomically, so a
  crash while a checkpoint is being written leaves ``latest.json`` on the previous one.
  Older checkpoints than the ``keep`` newest are removed after it.

Loading never executes code from the files: safetensors and JSON only (no pickle, no
``torch.load``). A missing, truncated, bit-flipped or edited file, or weights that do not fit
the model, raise :class:`~gymbridge.errors.CheckpointError` naming the file.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import torch

from gymbridge.errors import CheckpointError
from gymbridge.safe_io import load_state, save_state, write_atomic

if TYPE_CHECKING:
    from gymbridge.trainer.grpo import GRPOTrainer

logger = logging.getLogger(__name__)

__all__ = ["RunState", "latest_step", "load_checkpoint", "save_checkpoint"]

FORMAT = "gymbridge-run-checkpoint/1"
LATEST = "latest.json"


@dataclass(frozen=True)
class RunState:
    """Where a checkpointed run stood (the loop's counters; weights and RNG are restored in place)."""

    step: int
    """Steps done (the next step is ``step + 1``)."""
    policy_version: int
    done_task_indices: frozenset[int]
    path: Path
    """The ``.ckpt`` file it came from."""


def _rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    version, internal, gauss = random.getstate()
    tensors = {"rng.torch": torch.get_rng_state()}
    meta: dict[str, Any] = {"python": [version, list(internal), gauss]}
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with torch's wheels
        return tensors, meta
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    tensors["rng.numpy"] = torch.from_numpy(np.asarray(keys).astype(np.int64))
    meta["numpy"] = [name, int(pos), int(has_gauss), float(cached)]
    return tensors, meta


def _set_rng_state(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    try:
        version, internal, gauss = meta["python"]
        random.setstate((int(version), tuple(int(x) for x in internal), gauss))
        torch.set_rng_state(tensors["rng.torch"])
        if "numpy" in meta and "rng.numpy" in tensors:
            import numpy as np

            name, pos, has_gauss, cached = meta["numpy"]
            keys = tensors["rng.numpy"].numpy().astype(np.uint32)
            np.random.set_state((str(name), keys, int(pos), int(has_gauss), float(cached)))
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(path, f"malformed RNG state: {type(exc).__name__}: {exc}") from exc


def _optimizer_state(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, entry in state["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{pid}.{key}"] = value
            else:
                scalars.setdefault(str(pid), {})[key] = value
    return tensors, {"scalars": scalars, "param_groups": state["param_groups"]}


def _load_optimizer(
    path: Path, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
) -> None:
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        if not name.startswith("optim."):
            continue
        _, pid, key = name.split(".", 2)
        state.setdefault(int(pid), {})[key] = value
    try:
        for pid, entry in meta["scalars"].items():
            state.setdefault(int(pid), {}).update(entry)
        groups = [
            {k: (tuple(v) if k == "betas" else v) for k, v in group.items()} for group in meta["param_groups"]
        ]
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(path, f"optimizer state does not fit: {type(exc).__name__}: {exc}") from exc


def _name(step: int) -> str:
    return f"step-{step:06d}"


def save_checkpoint(
    directory: str | Path,
    *,
    step: int,
    policy_version: int,
    trainer: GRPOTrainer,
    done_task_indices: Iterable[int],
    keep: int = 2,
) -> Path:
    """Write the checkpoint of ``step`` under ``directory``; returns the ``.ckpt`` path."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    name = _name(step)
    tensors = {f"model.{k}": v.detach() for k, v in trainer.model.state_dict().items()}
    if trainer.reference is not None:
        tensors.update({f"reference.{k}": v.detach() for k, v in trainer.reference.state_dict().items()})
    optim_tensors, optim_meta = _optimizer_state(trainer.optimizer)
    rng_tensors, rng_meta = _rng_state()
    meta = {
        "format": FORMAT,
        "step": step,
        "policy_version": policy_version,
        "trainer_steps": trainer.steps,
        "done_task_indices": sorted(set(done_task_indices)),
        "optimizer": optim_meta,
        "rng": rng_meta,
    }
    ckpt = root / f"{name}.ckpt"
    save_state(ckpt, {**tensors, **optim_tensors, **rng_tensors}, meta)
    latest = {"format": FORMAT, "step": step, "state": ckpt.name}
    write_atomic(root / LATEST, [orjson.dumps(latest)])
    for old in sorted(root.glob("step-*.ckpt"))[:-keep] if keep > 0 else []:
        if old.name != ckpt.name:
            old.unlink(missing_ok=True)
    logger.debug("checkpoint of step %d -> %s", step, ckpt)
    return ckpt


def _latest(root: Path) -> dict[str, Any] | None:
    path = root / LATEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(path, f"unreadable: {exc.strerror or exc}") from exc
    try:
        latest = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise CheckpointError(path, f"not JSON: {exc}") from exc
    ok = (
        isinstance(latest, dict)
        and latest.get("format") == FORMAT
        and isinstance(latest.get("step"), int)
        and isinstance(latest.get("state"), str)
    )
    if not ok:
        raise CheckpointError(path, f"not a {FORMAT} pointer: {raw[:200]!r}")
    assert isinstance(latest, dict)
    value = latest["state"]  # a plain file name inside the checkpoints folder, nothing else
    if Path(value).name != value or value.startswith("."):
        raise CheckpointError(path, f"state {value!r} is not a file name in {root}")
    return dict(latest)


def latest_step(directory: str | Path) -> int | None:
    """The step of the newest checkpoint under ``directory`` (its ``latest.json``), ``None`` when there
    is none; a pointer that is not one is a :class:`~gymbridge.errors.CheckpointError`. The
    checkpoint itself is checked when it is loaded."""
    latest = _latest(Path(directory))
    return None if latest is None else int(latest["step"])


def load_checkpoint(directory: str | Path, *, trainer: GRPOTrainer) -> RunState | None:
    """Restore the latest checkpoint under ``directory`` into ``trainer`` (weights, optimizer) and
    the process RNGs; returns the run state, or ``None`` if there is none."""
    root = Path(directory)
    latest = _latest(root)
    if latest is None:
        return None
    ckpt = root / latest["state"]
    tensors, meta = load_state(ckpt)
    if meta.get("format") != FORMAT:
        raise CheckpointError(ckpt, f"format {meta.get('format')!r}, expected {FORMAT!r}")
    try:
        step, version = int(meta["step"]), int(meta["policy_version"])
        trainer_steps = int(meta["trainer_steps"])
        done = frozenset(int(i) for i in meta["done_task_indices"])
        optim_meta, rng_meta = meta["optimizer"], meta["rng"]
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(ckpt, f"malformed run state: {type(exc).__name__}: {exc}") from exc
    if step != latest["step"]:
        raise CheckpointError(ckpt, f"holds step {step}, {LATEST} says {latest['step']}")
    weights = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    try:
        trainer.model.load_state_dict(weights, strict=True)
    except RuntimeError as exc:
        raise CheckpointError(ckpt, f"weights do not fit this model: {exc}") from exc
    if trainer.reference is not None:
        ref = {k.removeprefix("reference."): v for k, v in tensors.items() if k.startswith("reference.")}
        if not ref:
            raise CheckpointError(ckpt, "holds no reference policy, but the trainer's kl_coef > 0 needs one")
        try:
            trainer.reference.load_state_dict(ref, strict=True)
        except RuntimeError as exc:
            raise CheckpointError(ckpt, f"reference weights do not fit this model: {exc}") from exc
    _load_optimizer(ckpt, trainer.optimizer, tensors, optim_meta)
    _set_rng_state(ckpt, tensors, rng_meta)
    trainer.steps = trainer_steps
    logger.info("resumed from %s (step %d, policy version %d, %d rows done)", ckpt, step, version, len(done))
    return RunState(step, version, done, ckpt)
