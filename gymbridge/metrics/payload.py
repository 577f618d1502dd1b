"""Payload metrics: the bytes that cross each named process boundary.

``payload_stats(obj)`` serialises ``obj`` with pickle protocol 5, counting the
in-band stream and every out-of-band buffer (what Ray / multiprocessing actually
ship), and walks ``obj`` for media to report physical bytes, logical bytes, and
segment / reference counts:

* a media ``PackedTensor``: physical = its unique segments, logical = every reference;
* a media string in JSON (the ``/run`` rows and results, agent -> model bodies): a
  ``data:`` URL of an image / audio / video type counts its encoded bytes (the base64
  payload decoded, computed from its length: no decoding) as logical **and** physical,
  since every copy carries them; a media reference (``http(s)://…/media/<key>``, see
  :mod:`gymbridge.media.store`) counts the referenced item's bytes (``media_size(key)``;
  0 when unknown) as logical, and as physical only the **first** time its key is seen in
  the scope ``sent_keys`` names (default: the one object measured; the bridge scopes it to
  one prompt's G rows, so "physical" is every media byte once per prompt, the ideal).
  The reference string itself (~100 B) is not media: it is in ``serialized_bytes``.

``PayloadMeter`` accumulates those stats per named boundary (docs/design.md, "Payload boundaries":
``gym_request``, ``gym_return``, ``prompt_repeat``, ``rollout_to_policy``,
``policy_shard``, ``generation``, and ``model_request``:
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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from gymbridge.media.store import parse_media_ref
from gymbridge.tensors.batch import TrainBatch
from gymbridge.tensors.packed import PackedTensor

MediaSize = Callable[[str], int | None]
"""The encoded size of the media item stored under a content key (``None``: unknown)."""

logger = logging.getLogger(__name__)

__all__ = ["BOUNDARIES", "BoundaryTotals", "PayloadMeter", "PayloadStats", "payload_stats"]

BOUNDARIES: tuple[str, ...] = (
    "gym_request",
    "gym_return",
    "prompt_repeat",
    "rollout_to_policy",
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
    elif isinstance(obj, TrainBatch):
        for value in obj.media.values():
            yield from _packed_tensors(value, seen)
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _packed_tensors(value, seen)
    elif isinstance(obj, list | tuple | set | frozenset):
        for value in obj:
            yield from _packed_tensors(value, seen)


_MEDIA_MAJORS = ("image/", "audio/", "video/")


def data_url_media_bytes(text: str) -> int | None:
    """The encoded media bytes a ``data:`` URL of an image / audio / video type carries
    (computed from the payload's length, nothing decoded), else ``None``."""
    if text[:5].lower() != "data:":
        return None
    comma = text.find(",", 5, 1029)
    if comma < 0:
        return None
    header = text[5:comma].lower()
    if not header.startswith(_MEDIA_MAJORS):
        return None
    n = len(text) - comma - 1
    if not header.endswith(";base64"):
        return n
    pad = 2 if text.endswith("==") else 1 if text.endswith("=") else 0
    return max(0, n * 3 // 4 - pad)


@dataclass
class _JsonMedia:
    physical: int = 0
    logical: int = 0
    segments: int = 0
    refs: int = 0


def _json_media(
    obj: Any, media_size: MediaSize | None, sent_keys: set[str], out: _JsonMedia, depth: int = 0
) -> None:
    if depth > 256:  # JSON from the wire is depth-checked already; a self-referencing object is not JSON
        return
    if isinstance(obj, str):
        if obj[:5].lower() == "data:":
            nbytes = data_url_media_bytes(obj)
            if nbytes is not None:
                out.physical += nbytes
                out.logical += nbytes
                out.segments += 1
                out.refs += 1
            return
        key = parse_media_ref(obj) if obj[:4].lower() == "http" else None
        if key is None:
            return
        size = (media_size(key) if media_size is not None else None) or 0
        out.logical += size
        out.refs += 1
        if key not in sent_keys:
            out.physical += size
            out.segments += 1
            sent_keys.add(key)
    elif isinstance(obj, Mapping):
        for value in obj.values():
            _json_media(value, media_size, sent_keys, out, depth + 1)
    elif isinstance(obj, list | tuple):
        for value in obj:
            _json_media(value, media_size, sent_keys, out, depth + 1)


def payload_stats(
    obj: Any, *, media_size: MediaSize | None = None, sent_keys: set[str] | None = None
) -> PayloadStats:
    """Serialise ``obj`` (pickle protocol 5, out-of-band buffers counted) and count its media bytes.

    Media found anywhere in ``obj`` (``PackedTensor``, ``TrainBatch`` media,
    media strings in JSON, inside dicts / lists / tuples) are summed; a segment shared by two
    containers in ``obj`` is counted once per container (each ships its own copy). A media
    reference's bytes count as physical once per key in ``sent_keys`` (which this call
    updates; ``None``: a fresh set, i.e. once per key in ``obj``); see the module docstring.
    """
    return _with_media(_serialized(obj), obj, media_size, sent_keys)


def _serialized(obj: Any) -> PayloadStats:
    buffers: list[pickle.PickleBuffer] = []
    stream = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    oob = sum(memoryview(b).nbytes for b in buffers)
    return PayloadStats(
        serialized_bytes=len(stream) + oob,
        inband_bytes=len(stream),
        out_of_band_bytes=oob,
        num_buffers=len(buffers),
        physical_media_bytes=0,
        logical_media_bytes=0,
        num_segments=0,
        num_refs=0,
    )


def _with_media(
    stats: PayloadStats, obj: Any, media_size: MediaSize | None, sent_keys: set[str] | None
) -> PayloadStats:
    media = _JsonMedia()
    for packed in _packed_tensors(obj, set()):
        media.physical += packed.physical_nbytes
        media.logical += packed.logical_nbytes
        media.segments += packed.num_segments
        media.refs += packed.num_refs
    _json_media(obj, media_size, set() if sent_keys is None else sent_keys, media)
    return replace(
        stats,
        physical_media_bytes=media.physical,
        logical_media_bytes=media.logical,
        num_segments=media.segments,
        num_refs=media.refs,
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

    ``media_size`` (e.g. :meth:`gymbridge.media.MediaStore.size`) gives the bytes behind a
    media reference; ``record(..., sent_keys=S)`` counts a reference's bytes as physical
    once per key in the caller's scope ``S`` (see :func:`payload_stats`).
    """

    def __init__(
        self,
        *,
        enabled: bool = False,
        extra_boundaries: Iterable[str] = (),
        media_size: MediaSize | None = None,
    ) -> None:
        self.enabled = enabled
        self.boundaries: tuple[str, ...] = BOUNDARIES + tuple(
            b for b in extra_boundaries if b not in BOUNDARIES
        )
        self.media_size = media_size
        self._totals: dict[str, BoundaryTotals] = {}
        self._lock = threading.Lock()

    def record(
        self, boundary: str, obj: Any, *, shard: int | None = None, sent_keys: set[str] | None = None
    ) -> PayloadStats | None:
        """Measure ``obj`` at ``boundary``; returns its stats, or ``None`` when the meter is off.

        ``sent_keys``: the media-reference keys already counted as physical in the caller's
        scope (updated here; see :func:`payload_stats`)."""
        if boundary not in self.boundaries:
            raise ValueError(f"unknown payload boundary {boundary!r}; known: {', '.join(self.boundaries)}")
        if not self.enabled:
            return None
        stats = payload_stats(obj, media_size=self.media_size, sent_keys=sent_keys)
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
