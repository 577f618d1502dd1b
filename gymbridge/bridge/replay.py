"""A replay buffer of complete GRPO groups, with atomic checkpoints.

The buffer stores **groups** (one :class:`~gymbridge.tensors.TrainBatch` per group, its
``group_ids`` all 0) in FIFO order up to ``capacity_groups``; :meth:`ReplayBuffer.sample`
draws whole groups without replacement and returns one batch with group ids renumbered
``0..n-1`` (group advantages stay valid: a group is never split).

Invariants:

* media stay deduplicated: groups share segments with the batch they came from, a
  sampled batch is re-interned by provenance (``TrainBatch.cat``), and a checkpoint
  stores every segment once (the groups are concatenated before pickling, so a segment
  referenced by several stored groups is written once);
* :meth:`ReplayBuffer.save` is atomic: the checkpoint is written to a temporary file in
  the same directory, flushed and fsynced, then ``os.replace`` d over the old one. A
  crash mid-write leaves the previous checkpoint intact and loadable;
* payload metrics ``replay_push`` / ``replay_sample`` are recorded when a meter is given.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import random
import tempfile
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gymbridge.errors import ReplayCheckpointError

if TYPE_CHECKING:
    from gymbridge.metrics import PayloadMeter
    from gymbridge.tensors import TrainBatch

logger = logging.getLogger(__name__)

__all__ = ["CHECKPOINT_VERSION", "ReplayBuffer", "ReplayCheckpointError", "cat_groups", "write_atomic"]

CHECKPOINT_VERSION = 1


def write_atomic(path: str | Path, chunks: Iterable[bytes]) -> None:
    """Write ``chunks`` to ``path`` atomically (temp file in the same directory + fsync + ``os.replace``).

    If anything fails before the rename (including the ``chunks`` iterable itself), the temp
    file is removed and whatever was at ``path`` before is untouched.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(target.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _split_groups(batch: TrainBatch) -> list[TrainBatch]:
    """One batch per group of ``batch`` (in order of first appearance), group ids set to 0."""
    from dataclasses import replace

    if len(batch) == 0:
        return []
    gids = batch.group_ids
    _, first = torch.unique(gids, return_inverse=True)
    order: list[int] = []
    for g in first.tolist():
        if g not in order:
            order.append(g)
    groups: list[TrainBatch] = []
    for g in order:
        idx = torch.nonzero(first == g).flatten()
        part = batch.select(idx)
        groups.append(replace(part, group_ids=torch.zeros(len(part), dtype=torch.int64)))
    return groups


def cat_groups(groups: list[TrainBatch]) -> TrainBatch:
    """One batch of whole ``groups`` (media re-interned by provenance): group ids ``0..n-1`` in order,
    sample ids renumbered densely per group, so rows of one split trajectory keep sharing an id
    and no two trajectories of different groups collide."""
    from dataclasses import replace

    from gymbridge.tensors import TrainBatch

    out = TrainBatch.cat(groups)
    sizes = torch.tensor([len(g) for g in groups], dtype=torch.int64)
    gids = torch.repeat_interleave(torch.arange(len(groups), dtype=torch.int64), sizes)
    sids: list[torch.Tensor] = []
    offset = 0
    for g in groups:
        if len(g):
            uniq, dense = torch.unique(g.sample_ids, return_inverse=True)
            sids.append(dense.to(torch.int64) + offset)
            offset += len(uniq)
    sample_ids = torch.cat(sids) if sids else torch.zeros(0, dtype=torch.int64)
    return replace(out, group_ids=gids, sample_ids=sample_ids)


class ReplayBuffer:
    """FIFO buffer of whole groups; see the module docstring."""

    def __init__(self, capacity_groups: int, *, seed: int = 0, meter: PayloadMeter | None = None) -> None:
        if capacity_groups < 1:
            raise ValueError(f"capacity_groups must be >= 1, got {capacity_groups}")
        self.capacity_groups = capacity_groups
        self.meter = meter
        self._rng = random.Random(seed)
        self._groups: deque[TrainBatch] = deque(maxlen=capacity_groups)
        self.pushed_groups = 0
        self.evicted_groups = 0

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def groups(self) -> list[TrainBatch]:
        return list(self._groups)

    def push(self, batch: TrainBatch) -> int:
        """Add every group of ``batch``; returns how many groups were added (oldest evicted first)."""
        if self.meter is not None:
            self.meter.record("replay_push", batch)
        groups = _split_groups(batch)
        for g in groups:
            if len(self._groups) == self.capacity_groups:
                self.evicted_groups += 1
            self._groups.append(g)
        self.pushed_groups += len(groups)
        return len(groups)

    def sample(self, num_groups: int) -> TrainBatch:
        """``num_groups`` distinct stored groups, drawn uniformly, as one batch (groups renumbered)."""
        if not 1 <= num_groups <= len(self._groups):
            raise ValueError(f"cannot sample {num_groups} group(s) from a buffer holding {len(self._groups)}")
        picked = sorted(self._rng.sample(range(len(self._groups)), num_groups))
        out = cat_groups([self._groups[i] for i in picked])
        if self.meter is not None:
            self.meter.record("replay_sample", out)
        return out

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict[str, Any]:
        """What a checkpoint holds: every group concatenated once (segments deduplicated) + sizes."""
        groups = list(self._groups)
        return {
            "version": CHECKPOINT_VERSION,
            "capacity_groups": self.capacity_groups,
            "group_sizes": [len(g) for g in groups],
            "batch": cat_groups(groups) if groups else None,
            "rng_state": self._rng.getstate(),
            "pushed_groups": self.pushed_groups,
            "evicted_groups": self.evicted_groups,
        }

    def save(self, path: str | Path) -> int:
        """Write a checkpoint atomically; returns its size in bytes."""
        data = pickle.dumps(self.state(), protocol=5)
        write_atomic(path, [data])
        logger.info("replay checkpoint: %d group(s), %d bytes -> %s", len(self._groups), len(data), path)
        return len(data)

    @classmethod
    def load(cls, path: str | Path, *, meter: PayloadMeter | None = None) -> ReplayBuffer:
        """Read a checkpoint written by :meth:`save`; raises :class:`ReplayCheckpointError` if unusable."""
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise ReplayCheckpointError(f"cannot read replay checkpoint {path}: {exc}") from exc
        try:
            state = pickle.loads(raw)
        except Exception as exc:  # a truncated or foreign file: unpickling can raise anything
            raise ReplayCheckpointError(
                f"replay checkpoint {path} is corrupt: {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(state, dict) or state.get("version") != CHECKPOINT_VERSION:
            found = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ReplayCheckpointError(
                f"replay checkpoint {path} has format version {found!r}, expected {CHECKPOINT_VERSION}"
            )
        try:
            buf = cls(int(state["capacity_groups"]), meter=meter)
            buf._rng.setstate(state["rng_state"])
            batch = state["batch"]
            start = 0
            for size in state["group_sizes"]:
                buf._groups.append(_split_groups(batch.select(slice(start, start + size)))[0])
                start += size
            buf.pushed_groups = int(state["pushed_groups"])
            buf.evicted_groups = int(state["evicted_groups"])
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise ReplayCheckpointError(
                f"replay checkpoint {path} has missing or malformed fields: {type(exc).__name__}: {exc}"
            ) from exc
        return buf
