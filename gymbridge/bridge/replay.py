"""A replay buffer of complete GRPO groups, with atomic checkpoints that cannot run code.

The buffer stores **groups** (one :class:`~gymbridge.tensors.TrainBatch` per group, its
``group_ids`` all 0) in FIFO order up to ``capacity_groups``; :meth:`ReplayBuffer.sample`
draws whole groups without replacement and returns one batch with group ids renumbered
``0..n-1`` (group advantages stay valid: a group is never split).

Invariants:

* media stay deduplicated: groups share segments with the batch they came from, a
  sampled batch is re-interned by provenance (``TrainBatch.cat``), and a checkpoint
  stores every segment once (the groups are concatenated before saving, so a segment
  referenced by several stored groups is written once);
* checkpoints are :func:`gymbridge.safe_io.save_state` files (safetensors + JSON + sha256,
  never pickle): loading a crafted file cannot run code, and a truncated, bit-flipped or
  edited file raises :class:`~gymbridge.errors.ReplayCheckpointError` (a
  ``CheckpointError``) naming the file and the reason; row metadata must be JSON-able;
* :meth:`ReplayBuffer.save` is atomic (:func:`~gymbridge.safe_io.write_atomic`): a crash
  mid-write leaves the previous checkpoint intact and loadable, and temp files of a killed
  save are removed at the next save or load;
* payload metrics ``replay_push`` / ``replay_sample`` are recorded when a meter is given.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gymbridge.errors import CheckpointError, ReplayCheckpointError
from gymbridge.safe_io import load_state, save_state, write_atomic
from gymbridge.tensors.batch import _ROW_TENSORS

if TYPE_CHECKING:
    from gymbridge.metrics import PayloadMeter
    from gymbridge.tensors import TrainBatch

logger = logging.getLogger(__name__)

__all__ = ["CHECKPOINT_VERSION", "ReplayBuffer", "ReplayCheckpointError", "cat_groups", "write_atomic"]

CHECKPOINT_VERSION = 2
"""Version 2: safe_io state files (version 1 was a pickle and is refused)."""


def batch_state(batch: TrainBatch, prefix: str = "batch") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, meta)`` of ``batch`` for :func:`~gymbridge.safe_io.save_state` (segments stored once)."""
    tensors: dict[str, torch.Tensor] = {f"{prefix}.{name}": getattr(batch, name) for name in _ROW_TENSORS}
    media: list[dict[str, Any]] = []
    for i, (key, packed) in enumerate(batch.media.items()):
        tensors[f"{prefix}.media.{i}.offsets"] = packed.offsets
        tensors[f"{prefix}.media.{i}.refs"] = packed.refs
        for j, seg in enumerate(packed.segments):
            tensors[f"{prefix}.media.{i}.seg.{j}"] = seg
        media.append({"key": key, "pack_dim": packed.pack_dim, "provenance": list(packed.provenance)})
    meta = {"media": media, "metadata": list(batch.metadata), "pad_token_id": batch.pad_token_id}
    return tensors, meta


def batch_from_state(
    tensors: dict[str, torch.Tensor], meta: dict[str, Any], prefix: str = "batch"
) -> TrainBatch:
    """The batch :func:`batch_state` described (its constructors re-check every invariant)."""
    from gymbridge.tensors import PackedTensor, TrainBatch

    media: dict[str, PackedTensor] = {}
    for i, m in enumerate(meta["media"]):
        segments = [tensors[f"{prefix}.media.{i}.seg.{j}"] for j in range(len(m["provenance"]))]
        media[str(m["key"])] = PackedTensor(
            segments,
            [str(p) for p in m["provenance"]],
            tensors[f"{prefix}.media.{i}.offsets"],
            tensors[f"{prefix}.media.{i}.refs"],
            pack_dim=int(m["pack_dim"]),
        )
    metadata = meta["metadata"]
    if not isinstance(metadata, list) or not all(isinstance(r, dict) for r in metadata):
        raise TypeError("metadata is not a list of objects")
    return TrainBatch(
        **{name: tensors[f"{prefix}.{name}"] for name in _ROW_TENSORS},
        media=media,
        metadata=tuple(metadata),
        pad_token_id=int(meta["pad_token_id"]),
    )


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
    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """What a checkpoint holds, as ``(tensors, meta)``: every group concatenated once
        (segments deduplicated), group sizes, the sampling RNG state and counters."""
        groups = list(self._groups)
        tensors: dict[str, torch.Tensor] = {}
        meta: dict[str, Any] = {
            "version": CHECKPOINT_VERSION,
            "capacity_groups": self.capacity_groups,
            "group_sizes": [len(g) for g in groups],
            "rng_state": _rng_state_json(self._rng.getstate()),
            "pushed_groups": self.pushed_groups,
            "evicted_groups": self.evicted_groups,
            "batch": None,
        }
        if groups:
            tensors, meta["batch"] = batch_state(cat_groups(groups))
        return tensors, meta

    def save(self, path: str | Path) -> int:
        """Write a checkpoint atomically; returns its size in bytes."""
        tensors, meta = self.state()
        size = save_state(path, tensors, meta)
        logger.info("replay checkpoint: %d group(s), %d bytes -> %s", len(self._groups), size, path)
        return size

    @classmethod
    def load(cls, path: str | Path, *, meter: PayloadMeter | None = None) -> ReplayBuffer:
        """Read a checkpoint written by :meth:`save`; raises :class:`ReplayCheckpointError` if unusable."""
        try:
            tensors, meta = load_state(path)
        except CheckpointError as exc:
            raise ReplayCheckpointError(path, exc.reason) from exc
        if meta.get("version") != CHECKPOINT_VERSION:
            raise ReplayCheckpointError(
                path, f"format version {meta.get('version')!r}, expected {CHECKPOINT_VERSION}"
            )
        try:
            buf = cls(int(meta["capacity_groups"]), meter=meter)
            buf._rng.setstate(_rng_state_from_json(meta["rng_state"]))
            sizes = [int(n) for n in meta["group_sizes"]]
            if sizes:
                batch = batch_from_state(tensors, meta["batch"])
                if sum(sizes) != len(batch) or min(sizes) < 1:
                    raise ValueError(f"group sizes {sizes} do not cover the {len(batch)} stored rows")
                start = 0
                for size in sizes:
                    buf._groups.append(_split_groups(batch.select(slice(start, start + size)))[0])
                    start += size
            buf.pushed_groups = int(meta["pushed_groups"])
            buf.evicted_groups = int(meta["evicted_groups"])
        except Exception as exc:  # checksummed but inconsistent (a hand-made file): never a bare error
            raise ReplayCheckpointError(
                path, f"missing or malformed fields: {type(exc).__name__}: {exc}"
            ) from exc
        return buf


def _rng_state_json(state: tuple[Any, ...]) -> list[Any]:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _rng_state_from_json(value: Any) -> tuple[Any, ...]:
    version, internal, gauss = value
    if not all(isinstance(x, int) for x in internal):
        raise TypeError("rng_state holds non-integers")
    return (int(version), tuple(internal), None if gauss is None else float(gauss))
