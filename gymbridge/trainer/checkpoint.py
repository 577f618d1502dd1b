"""Run checkpoints: everything a killed run needs to continue as if it had not stopped.

A checkpoint of step ``s`` (``DIR/checkpoints/``) is

* ``step-<s>.ckpt``: one :func:`gymbridge.safe_io.save_state` file (safetensors + JSON + sha256)
  with the policy weights (``model.<name>``), the optimizer's tensors (``optim.<param>.<key>``)
  and the torch RNG state (``rng.torch``) as tensors, and with ``kl_coef > 0`` the frozen
  reference policy (``reference.<name>``: the run's initial weights, which a resumed run
  must score its KL against, not its checkpoint's); the JSON part holds the step count, the
  policy version, the optimizer's scalar state and param groups, the Python and NumPy RNG
  states and the iterator's position: the dataset rows whose group was consumed (trained,
  failed or dropped) as ranges, ``done_rows: [[start, stop], ...]`` (half-open; a
  :class:`~gymbridge.rowset.RowSet`, a few ranges however many rows are done; a checkpoint
  written before them lists every row in ``done_task_indices`` and still loads). Groups in
  flight at the checkpoint are not in it, so a resumed run starts them again and trains each
  row once;
* or, written by FSDP workers (:func:`save_sharded_checkpoint`), ``step-<s>/``: a folder holding
  a :mod:`gymbridge.trainer.sharded_checkpoint` checkpoint (every rank's slices of the policy,
  its AdamW state ``optim.<fqn>.<key>`` and the reference ``reference.<fqn>``; the optimizer's
  scalar state and param groups in its ``index.json``), then ``run.state``: the driver's
  :func:`~gymbridge.safe_io.save_state` file with the RNG tensors and the same JSON as above
  less the optimizer's. The driver never holds the optimizer state; a folder loads on any number of
  FSDP workers (each reads its slices), into one process, or into replicated workers;
* with LoRA (:mod:`gymbridge.trainer.lora`) both kinds hold only what training changes (the
  adapters, and the encoders with ``vision: full``) and their optimizer state, and the JSON says
  ``lora`` (the adapter settings): the base weights are the run's model source; a checkpoint loads
  only into a model with the same settings (full weights into full weights);
* ``latest.json``: ``{"format", "step", "state", "kind"}`` (``kind``: ``"file"`` or
  ``"sharded"``; a pointer without one is a file's), written **last** and atomically, so a
  crash while a checkpoint is being written leaves ``latest.json`` on the previous one.
  Older checkpoints (files and folders) than the ``keep`` newest are removed after it.

Loading never executes code from the files: safetensors and JSON only (no pickle, no
``torch.load``). A missing, truncated, bit-flipped or edited file, or weights that do not fit
the model, raise :class:`~gymbridge.errors.CheckpointError` naming the file.
"""

from __future__ import annotations

import logging
import random
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import torch

from gymbridge.errors import CheckpointError
from gymbridge.generation.lora import lora_settings, published_names, settings_differ
from gymbridge.rowset import RowSet
from gymbridge.safe_io import load_state, save_state, write_atomic

if TYPE_CHECKING:
    from gymbridge.trainer.grpo import GRPOTrainer

logger = logging.getLogger(__name__)

__all__ = ["RunState", "latest_step", "load_checkpoint", "save_checkpoint", "save_sharded_checkpoint"]

FORMAT = "gymbridge-run-checkpoint/1"
LATEST = "latest.json"
RUN_STATE = "run.state"
"""The driver's file in a sharded checkpoint's folder: the run's counters and RNG states."""
_KINDS = ("file", "sharded")
_STEP_NAME = re.compile(r"^step-(\d+)(\.ckpt)?$")


@dataclass(frozen=True)
class RunState:
    """Where a checkpointed run stood (the loop's counters; weights and RNG are restored in place)."""

    step: int
    """Steps done (the next step is ``step + 1``)."""
    policy_version: int
    done_task_indices: RowSet
    """The rows done (a set of row indices held as ranges)."""
    path: Path
    """The ``.ckpt`` file or the sharded checkpoint's folder it came from."""
    sharded: bool = False
    """``path`` is a sharded checkpoint's folder (FSDP workers load their slices from it)."""


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
    tensors = {f"model.{k}": v.detach() for k, v in _saved_weights(trainer.model).items()}
    if trainer.reference is not None:
        tensors.update({f"reference.{k}": v.detach() for k, v in trainer.reference.state_dict().items()})
    optim_tensors, optim_meta = _optimizer_state(trainer.optimizer)
    rng_tensors, meta = _run_meta(step, policy_version, trainer, done_task_indices)
    if (lora := lora_settings(trainer.model)) is not None:
        meta["lora"] = lora
    ckpt = root / f"{name}.ckpt"
    save_state(ckpt, {**tensors, **optim_tensors, **rng_tensors}, {**meta, "optimizer": optim_meta})
    _point_and_prune(root, step, ckpt, "file", keep)
    return ckpt


def save_sharded_checkpoint(
    directory: str | Path,
    *,
    step: int,
    policy_version: int,
    trainer: GRPOTrainer,
    done_task_indices: Iterable[int],
    write_shards: Callable[[Path, dict[str, Any]], None],
    keep: int = 2,
) -> Path:
    """Write the checkpoint of ``step`` as the folder ``directory/step-<s>/``; returns the folder.

    ``write_shards(folder, meta)`` has the workers write their slices there
    (:meth:`gymbridge.trainer.ray_dp.RayDPTrainer.save_sharded_checkpoint`: ``save_sharded`` on
    every rank, ``meta`` added to its ``index.json``); then the driver writes :data:`RUN_STATE`
    (``trainer``'s step count, the RNG states, the rows done: no weights, no optimizer state)
    and ``latest.json``.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    folder = root / _name(step)
    write_shards(folder, {"run_step": step})
    rng_tensors, meta = _run_meta(step, policy_version, trainer, done_task_indices)
    save_state(folder / RUN_STATE, rng_tensors, {**meta, "kind": "sharded"})
    _point_and_prune(root, step, folder, "sharded", keep)
    return folder


def _saved_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps of ``model``: every entry, or with LoRA only what training changes
    (:func:`~gymbridge.trainer.lora.published_names`: the base is the run's model source)."""
    state = model.state_dict()
    keep = published_names(model)
    return state if keep is None else {k: v for k, v in state.items() if k in keep}


def _check_lora(path: Path, saved: Any, model: torch.nn.Module) -> None:
    """A checkpoint's ``lora`` settings (``None``: full weights) must be the model's."""
    held = lora_settings(model)
    if saved is None and held is None:
        return
    if held is None:
        raise CheckpointError(
            path, f"holds LoRA adapters ({saved}); this run trains full weights (trainer.lora off)"
        )
    if saved is None:
        raise CheckpointError(path, f"holds full weights; this run trains LoRA adapters ({held})")
    if not isinstance(saved, dict):
        raise CheckpointError(path, f"malformed LoRA settings: {saved!r}")
    if not settings_differ(saved, held):  # dropout may change on a resume
        return
    raise CheckpointError(path, f"holds LoRA adapters {saved}, this run's are {held}")


def _run_meta(
    step: int, policy_version: int, trainer: GRPOTrainer, done_task_indices: Iterable[int]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The RNG tensors and the JSON every checkpoint holds (less the optimizer's)."""
    rng_tensors, rng_meta = _rng_state()
    meta = {
        "format": FORMAT,
        "step": step,
        "policy_version": policy_version,
        "trainer_steps": trainer.steps,
        "done_rows": _as_rowset(done_task_indices).ranges(),
        "rng": rng_meta,
    }
    return rng_tensors, meta


def _as_rowset(rows: Iterable[int]) -> RowSet:
    return rows if isinstance(rows, RowSet) else RowSet(rows)


def _point_and_prune(root: Path, step: int, state: Path, kind: str, keep: int) -> None:
    """Write ``latest.json`` (last, atomically), then remove checkpoints older than the ``keep`` newest."""
    latest = {"format": FORMAT, "step": step, "state": state.name, "kind": kind}
    write_atomic(root / LATEST, [orjson.dumps(latest)])
    found = [(int(m[1]), p) for p in root.iterdir() if (m := _STEP_NAME.match(p.name)) is not None]
    for _, old in sorted(found)[:-keep] if keep > 0 else []:
        if old.name == state.name:
            continue
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
    logger.debug("checkpoint of step %d -> %s", step, state)


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
        and latest.setdefault("kind", "file") in _KINDS  # written before sharded checkpoints: a file
    )
    if not ok:
        raise CheckpointError(path, f"not a {FORMAT} pointer: {raw[:200]!r}")
    assert isinstance(latest, dict)
    value = latest["state"]  # a plain file name inside the checkpoints folder, nothing else
    if Path(value).name != value or value.startswith("."):
        raise CheckpointError(path, f"state {value!r} is not a file name in {root}")
    if latest["kind"] == "sharded" and _STEP_NAME.match(value) is None:
        raise CheckpointError(path, f"state {value!r} is not a step-<s> folder")
    return dict(latest)


def latest_step(directory: str | Path) -> int | None:
    """The step of the newest checkpoint under ``directory`` (its ``latest.json``), ``None`` when there
    is none; a pointer that is not one is a :class:`~gymbridge.errors.CheckpointError`. The
    checkpoint itself is checked when it is loaded."""
    latest = _latest(Path(directory))
    return None if latest is None else int(latest["step"])


def load_checkpoint(
    directory: str | Path, *, trainer: GRPOTrainer, optimizer: bool = True
) -> RunState | None:
    """Restore the latest checkpoint under ``directory`` into ``trainer`` (weights, optimizer) and
    the process RNGs; returns the run state, or ``None`` if there is none.

    From a sharded checkpoint the weights are copied in one tensor at a time, and the optimizer
    state only with ``optimizer`` (``False``: FSDP workers load their slices of it themselves,
    :meth:`gymbridge.trainer.ray_dp.RayDPTrainer.load_sharded_checkpoint`, and the driver's
    optimizer stays blank). A file's optimizer state is always loaded (it seeds the workers).
    """
    root = Path(directory)
    latest = _latest(root)
    if latest is None:
        return None
    if latest["kind"] == "sharded":
        return _load_sharded(root / latest["state"], int(latest["step"]), trainer, optimizer)
    ckpt = root / latest["state"]
    tensors, meta = load_state(ckpt)
    step, version, trainer_steps, done, rng_meta = _check_run_meta(ckpt, meta, int(latest["step"]))
    try:
        optim_meta = meta["optimizer"]
    except KeyError as exc:
        raise CheckpointError(ckpt, "malformed run state: no optimizer") from exc
    weights = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    _check_lora(ckpt, meta.get("lora"), trainer.model)
    keep = published_names(trainer.model)
    try:
        if keep is None:
            trainer.model.load_state_dict(weights, strict=True)
        elif set(weights) != keep:
            wrong = sorted(set(weights) ^ keep)
            raise RuntimeError(f"{len(wrong)} adapter tensors differ, e.g. {wrong[:3]}")
        else:
            trainer.model.load_state_dict(weights, strict=False)
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


def _check_run_meta(
    path: Path, meta: dict[str, Any], expected_step: int
) -> tuple[int, int, int, RowSet, dict[str, Any]]:
    """``(step, policy version, trainer steps, rows done, RNG meta)`` of a checkpoint's JSON."""
    if meta.get("format") != FORMAT:
        raise CheckpointError(path, f"format {meta.get('format')!r}, expected {FORMAT!r}")
    try:
        step, version = int(meta["step"]), int(meta["policy_version"])
        trainer_steps = int(meta["trainer_steps"])
        if "done_rows" in meta:
            done = RowSet.from_ranges(meta["done_rows"])
        else:  # written before the ranges: every row listed
            done = RowSet(int(i) for i in meta["done_task_indices"])
        rng_meta = meta["rng"]
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(path, f"malformed run state: {type(exc).__name__}: {exc}") from exc
    if step != expected_step:
        raise CheckpointError(path, f"holds step {step}, {LATEST} says {expected_step}")
    return step, version, trainer_steps, done, rng_meta


def _copy_weights(folder: Path, prefix: str, model: torch.nn.Module) -> None:
    """Copy the checkpoint's ``prefix`` tensors into ``model``'s state dict, one whole tensor at a time."""
    from gymbridge.trainer.sharded_checkpoint import INDEX_NAME, iter_full_tensors

    targets = _saved_weights(model)
    seen: set[str] = set()
    with torch.no_grad():
        for name, tensor in iter_full_tensors(folder, prefix=prefix):
            key = name.removeprefix(prefix)
            target = targets.get(key)
            if target is None or target.shape != tensor.shape:
                got = "nothing" if target is None else f"shape {list(target.shape)}"
                raise CheckpointError(
                    folder / INDEX_NAME, f"{name!r} {list(tensor.shape)} does not fit this model ({got})"
                )
            target.copy_(tensor)
            seen.add(key)
    if missing := sorted(set(targets) - seen):
        what = "a reference policy" if prefix == "reference." else "these weights"
        raise CheckpointError(
            folder / INDEX_NAME, f"holds no {what} for {len(missing)} tensors, e.g. {missing[:3]}"
        )


def _load_sharded(folder: Path, expected_step: int, trainer: GRPOTrainer, optimizer: bool) -> RunState:
    from gymbridge.trainer.sharded_checkpoint import INDEX_NAME, full_optimizer_state, read_meta

    state = folder / RUN_STATE
    tensors, meta = load_state(state)
    step, version, trainer_steps, done, rng_meta = _check_run_meta(state, meta, expected_step)
    shards_meta = read_meta(folder)  # every index checked: a folder without index.json is no checkpoint
    if shards_meta.get("run_step") != step:
        raise CheckpointError(
            folder / INDEX_NAME, f"holds step {shards_meta.get('run_step')!r}, {RUN_STATE} says {step}"
        )
    _check_lora(folder / INDEX_NAME, shards_meta.get("lora"), trainer.model)
    _copy_weights(folder, "model.", trainer.model)
    if trainer.reference is not None:
        _copy_weights(folder, "reference.", trainer.reference)
    if optimizer:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        osd: Any = full_optimizer_state(folder)  # FQN-keyed, as the workers' optimizers saved it
        try:
            set_optimizer_state_dict(trainer.model, trainer.optimizer, osd)
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise CheckpointError(
                folder / INDEX_NAME, f"optimizer state does not fit: {type(exc).__name__}: {exc}"
            ) from exc
    _set_rng_state(state, tensors, rng_meta)
    trainer.steps = trainer_steps
    logger.info(
        "resumed from %s (sharded, step %d, policy version %d, %d rows done)",
        folder,
        step,
        version,
        len(done),
    )
    return RunState(step, version, done, folder, sharded=True)
