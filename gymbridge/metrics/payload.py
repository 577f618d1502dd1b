"""Payload metrics: the bytes that cross each named process boundary.

``payload_stats(obj)`` serialises ``obj`` with pickle protocol 5, counting the
in-band stream and every out-of-band buffer (what Ray / multiprocessing actually
ship), and walks ``obj`` for media ``PackedTensor`` s to report physical bytes
(unique segments), logical bytes (every reference), and segment / reference counts.

``PayloadMeter`` accumulates those stats per named boundary (docs/design.md, "Payload boundaries":
``gym_request``, ``gym_return``, ``prompt_repeat``, ``rollout_to_policy``,
``replay_push``, ``replay_sample``, ``policy_shard``, ``generation``, and ``model_request``:
agent -> model server JSON, recorded by the agent with :meth:`PayloadMeter.record_stats`), with per-shard
totals and maxima. It is **off by default** (measuring costs one serialisation per
record) and prints a table.

Invariants: ``serialized_bytes == inband_bytes + out_of_band_bytes``;
``physical_media_bytes <= logical_media_bytes``; a disabled meter records nothing
and never serialises; one meter may be shared by threads (the smoke launcher records
``policy_shard`` from the trainer's thread while the event loop records rollouts): the
totals are updated and read under a lock, the serialisation itself runs outside it.
"""

from __future__ import annotations

import logging
import pickle
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from gymbridge.tensors.batch import PackedBatch, TrainBatch
from gymbridge.tensors.packed import PackedTensor

logger = logging.getLogger(__name__)

__all__ = ["BOUNDARIES", "BoundaryTotals", "PayloadMeter", "PayloadStats", "payload_stats"]

BOUNDARIES: tuple[str, ...] = (
    "gym_request",
    "gym_return",
    "prompt_repeat",
    "rollout_to_policy",
    "replay_push",
    "replay_sample",
    "policy_shard",
    "generation",
    "model_request",
)
"""The named boundaries (docs/design.md, "Payload boundaries")."""


@dataclass(frozen=True)
class PayloadStats:
    """What one object costs to send. Bytes are exact byte counts."""

    serialized_bytes: int
    """In-band pickle stream plus every out-of-band buffer."""
    inband_bytes: int
    out_of_band_bytes: int
    num_buffers: int
    physical_media_bytes: int
    """Bytes of the unique media segments (what deduplication ships)."""
    logical_media_bytes: int
    """Bytes of every media reference (what a dense copy would ship)."""
    num_segments: int
    num_refs: int

    @property
    def dedup_ratio(self) -> float:
        """Logical / physical media bytes: the ideal saving of deduplication (1.0 without media)."""
        return self.logical_media_bytes / self.physical_media_bytes if self.physical_media_bytes else 1.0


def _packed_tensors(obj: Any, seen: set[int]) -> Iterable[PackedTensor]:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, PackedTensor):
        yield obj
    elif isinstance(obj, TrainBatch | PackedBatch):
        for value in obj.media.values():
            yield from _packed_tensors(value, seen)
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _packed_tensors(value, seen)
    elif isinstance(obj, list | tuple | set | frozenset):
        for value in obj:
            yield from _packed_tensors(value, seen)


def payload_stats(obj: Any) -> PayloadStats:
    """Serialise ``obj`` (pickle protocol 5, out-of-band buffers counted) and count its media bytes.

    Media found anywhere in ``obj`` (``PackedTensor``, ``TrainBatch``/``PackedBatch`` media,
    inside dicts / lists / tuples) are summed; a segment shared by two containers in ``obj``
    is counted once per container (each ships its own copy).
    """
    buffers: list[pickle.PickleBuffer] = []
    stream = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    oob = sum(memoryview(b).nbytes for b in buffers)
    physical = logical = segments = refs = 0
    for packed in _packed_tensors(obj, set()):
        physical += packed.physical_nbytes
        logical += packed.logical_nbytes
        segments += packed.num_segments
        refs += packed.num_refs
    return PayloadStats(
        serialized_bytes=len(stream) + oob,
        inband_bytes=len(stream),
        out_of_band_bytes=oob,
        num_buffers=len(buffers),
        physical_media_bytes=physical,
        logical_media_bytes=logical,
        num_segments=segments,
        num_refs=refs,
    )


@dataclass
class BoundaryTotals:
    """Accumulated stats of one boundary: totals over records and per-shard totals / maxima."""

    records: int = 0
    serialized_bytes: int = 0
    physical_media_bytes: int = 0
    logical_media_bytes: int = 0
    num_segments: int = 0
    num_refs: int = 0
    max_serialized_bytes: int = 0
    shard_serialized_bytes: dict[int, int] = field(default_factory=dict)
    """Total serialised bytes per shard index (records made with ``shard=``)."""

    @property
    def max_shard_bytes(self) -> int:
        return max(self.shard_serialized_bytes.values(), default=0)

    @property
    def dedup_ratio(self) -> float:
        return self.logical_media_bytes / self.physical_media_bytes if self.physical_media_bytes else 1.0

    def add(self, stats: PayloadStats, shard: int | None) -> None:
        self.records += 1
        self.serialized_bytes += stats.serialized_bytes
        self.physical_media_bytes += stats.physical_media_bytes
        self.logical_media_bytes += stats.logical_media_bytes
        self.num_segments += stats.num_segments
        self.num_refs += stats.num_refs
        self.max_serialized_bytes = max(self.max_serialized_bytes, stats.serialized_bytes)
        if shard is not None:
            self.shard_serialized_bytes[shard] = (
                self.shard_serialized_bytes.get(shard, 0) + stats.serialized_bytes
            )


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"  # pragma: no cover - loop always returns


class PayloadMeter:
    """Per-boundary payload accounting; off unless ``enabled=True``.

    ``record(boundary, obj, shard=None)`` measures ``obj`` with :func:`payload_stats`
    and adds it to the boundary's totals (and to shard ``shard``'s total). Unknown
    boundary names raise ``ValueError`` unless declared in ``extra_boundaries``.
    ``report()`` gives the totals, ``table()`` a printable table, ``reset()`` starts
    a new step.
    """

    def __init__(self, *, enabled: bool = False, extra_boundaries: Iterable[str] = ()) -> None:
        self.enabled = enabled
        self.boundaries: tuple[str, ...] = BOUNDARIES + tuple(
            b for b in extra_boundaries if b not in BOUNDARIES
        )
        self._totals: dict[str, BoundaryTotals] = {}
        self._lock = threading.Lock()

    def record(self, boundary: str, obj: Any, *, shard: int | None = None) -> PayloadStats | None:
        """Measure ``obj`` at ``boundary``; returns its stats, or ``None`` when the meter is off."""
        if boundary not in self.boundaries:
            raise ValueError(f"unknown payload boundary {boundary!r}; known: {', '.join(self.boundaries)}")
        if not self.enabled:
            return None
        stats = payload_stats(obj)
        with self._lock:
            self._totals.setdefault(boundary, BoundaryTotals()).add(stats, shard)
        logger.debug("payload %s shard=%s: %d bytes", boundary, shard, stats.serialized_bytes)
        return stats

    def record_stats(self, boundary: str, stats: PayloadStats, *, shard: int | None = None) -> None:
        """Add stats measured elsewhere (e.g. a JSON body's media, ``model_request``) to ``boundary``."""
        if boundary not in self.boundaries:
            raise ValueError(f"unknown payload boundary {boundary!r}; known: {', '.join(self.boundaries)}")
        if not self.enabled:
            return
        with self._lock:
            self._totals.setdefault(boundary, BoundaryTotals()).add(stats, shard)

    def report(self) -> dict[str, BoundaryTotals]:
        """Totals per boundary, in the order of :attr:`boundaries` (only boundaries with records).

        The values are snapshots: later records do not change them.
        """
        with self._lock:
            return {
                b: replace(t, shard_serialized_bytes=dict(t.shard_serialized_bytes))
                for b in self.boundaries
                if (t := self._totals.get(b)) is not None
            }

    def reset(self) -> None:
        with self._lock:
            self._totals.clear()

    def table(self) -> str:
        """A fixed-width table: one line per boundary with records."""
        header = (
            f"{'boundary':<18} {'records':>7} {'serialized':>12} {'max/record':>12} {'max shard':>12} "
            f"{'physical':>12} {'logical':>12} {'ratio':>7} {'segments':>8} {'refs':>6}"
        )
        lines = [header, "-" * len(header)]
        for name, t in self.report().items():
            shard = _fmt_bytes(t.max_shard_bytes) if t.shard_serialized_bytes else "-"
            lines.append(
                f"{name:<18} {t.records:>7} {_fmt_bytes(t.serialized_bytes):>12} "
                f"{_fmt_bytes(t.max_serialized_bytes):>12} {shard:>12} "
                f"{_fmt_bytes(t.physical_media_bytes):>12} {_fmt_bytes(t.logical_media_bytes):>12} "
                f"{t.dedup_ratio:>6.2f}x {t.num_segments:>8} {t.num_refs:>6}"
            )
        return "\n".join(lines)
