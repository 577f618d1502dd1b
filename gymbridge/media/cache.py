"""``MediaCache``: fetched, decoded and processed media by content key, bounded by bytes (LRU).

The model server sees the same image many times: the G rollouts of a group share their
prompt's image, and every later call of a conversation re-sends every earlier image. This
cache keeps, per content key (:func:`gymbridge.media.hashing.content_key`):

* ``fetched``: a loaded :class:`~gymbridge.media.MediaItem` of a media-store reference
  (``.../media/<key>``), so a reference is fetched once (the fetch verifies the bytes
  against the key; an item whose bytes do not hash to the key is never cached);
* ``decoded:<modality>``: the decoded medium (PIL image, frames, waveform);
* ``processed:<modality>``: the sub-processor's tensors, what both the placeholder
  expansion and the model's forward consume (the tensor layer fills it:
  :func:`gymbridge.tensors.processor.process_cached`).

Invariants:

* the bound is ``max_bytes`` over all entries (each entry's size estimated from its
  bytes / pixels / tensor storage); the least recently used entries go first; an entry
  bigger than the whole bound is returned but not kept; ``max_bytes=0`` keeps nothing;
* concurrent callers asking for the same missing entry wait for one computation: a
  group's G requests arriving together decode and process the image once;
* a computation that raises is not cached (every waiter gets the exception; the next
  call tries again);
* cached values are shared between requests and must be treated as read-only (every
  consumer copies: ``torch.cat`` / ``.to(device)``, PIL conversions);
* :meth:`stats` reports entries, bytes and per-kind hits / misses / evictions (the
  model server serves it at ``GET /media_cache`` and logs it at shutdown).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["DEFAULT_MEDIA_CACHE_BYTES", "KindStats", "MediaCache", "value_nbytes"]

T = TypeVar("T")

DEFAULT_MEDIA_CACHE_BYTES = 512 * 1024 * 1024
"""The model server's default bound (``--media-cache-bytes``)."""


@dataclass
class KindStats:
    """Counters of one kind of entry."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_computed: int = 0
    """Bytes of every value computed on a miss (what caching saves on each hit, roughly)."""


def value_nbytes(value: Any) -> int:
    """An estimate of the memory ``value`` holds (tensors, arrays, PIL images, bytes, items, containers)."""
    if value is None:
        return 0
    if isinstance(value, bytes | bytearray | memoryview):
        return len(value)
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int) and not callable(nbytes):
        return nbytes  # numpy arrays, MediaItem
    if hasattr(value, "element_size") and hasattr(value, "numel"):
        return int(value.element_size()) * int(value.numel())  # torch tensors
    if hasattr(value, "size") and hasattr(value, "getbands"):
        width, height = value.size  # PIL image
        return int(width) * int(height) * len(value.getbands())
    if isinstance(value, dict):
        return sum(value_nbytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(value_nbytes(v) for v in value)
    if hasattr(value, "frames"):
        return value_nbytes(value.frames)
    return 64


class MediaCache:
    """See the module docstring. Thread-safe; one per model server."""

    def __init__(self, max_bytes: int = DEFAULT_MEDIA_CACHE_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()
        self._inflight: dict[tuple[str, str], Future[Any]] = {}
        self._bytes = 0
        self._kinds: dict[str, KindStats] = {}
        self._lock = threading.Lock()

    def _kind(self, kind: str) -> KindStats:
        stats = self._kinds.get(kind)
        if stats is None:
            stats = self._kinds[kind] = KindStats()
        return stats

    def get_or_make(self, kind: str, key: str, make: Callable[[], T]) -> T:
        """The cached ``(kind, key)`` value, else ``make()``'s (kept within the bound)."""
        slot = (kind, key)
        with self._lock:
            stats = self._kind(kind)
            entry = self._entries.get(slot)
            if entry is not None:
                self._entries.move_to_end(slot)
                stats.hits += 1
                return entry[0]  # type: ignore[no-any-return]
            pending = self._inflight.get(slot)
            if pending is None:
                stats.misses += 1
                mine: Future[Any] = Future()
                self._inflight[slot] = mine
            else:
                stats.hits += 1
        if pending is not None:
            return pending.result()  # type: ignore[no-any-return]
        try:
            value = make()
        except BaseException as exc:
            with self._lock:
                self._inflight.pop(slot, None)
            mine.set_exception(exc)
            mine.exception()  # retrieved: no "never retrieved" warning when nobody waited
            raise
        size = value_nbytes(value)
        with self._lock:
            self._inflight.pop(slot, None)
            stats.bytes_computed += size
            if self.max_bytes > 0 and size <= self.max_bytes:
                self._entries[slot] = (value, size)
                self._bytes += size
                self._evict()
        mine.set_result(value)
        return value

    def _evict(self) -> None:
        while self._bytes > self.max_bytes and self._entries:
            (kind, _), (_, size) = self._entries.popitem(last=False)
            self._bytes -= size
            self._kind(kind).evictions += 1

    def stats(self) -> dict[str, Any]:
        """``{max_bytes, bytes, entries, kinds: {kind: {hits, misses, evictions, bytes_computed}}}``."""
        with self._lock:
            return {
                "max_bytes": self.max_bytes,
                "bytes": self._bytes,
                "entries": len(self._entries),
                "kinds": {
                    kind: {
                        "hits": s.hits,
                        "misses": s.misses,
                        "evictions": s.evictions,
                        "bytes_computed": s.bytes_computed,
                    }
                    for kind, s in sorted(self._kinds.items())
                },
            }

    def clear(self) -> None:
        """Drop every entry (counters are kept)."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0
