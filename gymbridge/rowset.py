"""``RowSet``: a set of non-negative row indices held as sorted, disjoint ranges.

A run marks every dataset row it finished (trained, failed or dropped) as done; rows finish
almost in order, so the done rows of a 200,000-row run are a handful of ranges, not 200,000
integers. The bridge's resumable position, the rows a resumed run skips and a checkpoint's
``done_rows`` (``[[start, stop], ...]``, half-open) are all one :class:`RowSet`.

Invariants: ranges are half-open ``[start, stop)``, sorted, disjoint and never adjacent
(``[0, 3)`` and ``[3, 5)`` are stored as ``[0, 5)``); ``len`` is kept, not counted; memory
grows with the number of gaps, not with the number of rows.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator, MutableSet, Sequence
from typing import Any

__all__ = ["RowSet"]


class RowSet(MutableSet[int]):
    """A mutable set of row indices (``int >= 0``) stored as ranges (module docstring)."""

    __slots__ = ("_len", "_starts", "_stops")

    def __init__(self, rows: Iterable[int] = ()) -> None:
        self._starts: list[int] = []
        self._stops: list[int] = []
        self._len = 0
        for row in rows:
            self.add(row)

    @classmethod
    def from_ranges(cls, ranges: Iterable[Sequence[int]]) -> RowSet:
        """The rows of ``[[start, stop], ...]`` (half-open; any order, overlaps allowed).

        Raises ``ValueError`` for a range that is not two integers ``0 <= start <= stop``."""
        out = cls()
        for pair in ranges:
            if (
                len(pair) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair)
                or not 0 <= pair[0] <= pair[1]
            ):
                raise ValueError(f"a row range is [start, stop] with 0 <= start <= stop, got {pair!r}")
            out.add_range(pair[0], pair[1])
        return out

    def ranges(self) -> list[list[int]]:
        """``[[start, stop], ...]``, sorted and half-open: the JSON form."""
        return [[a, b] for a, b in zip(self._starts, self._stops, strict=True)]

    # ------------------------------------------------------------------ Set
    def __contains__(self, row: object) -> bool:
        if not isinstance(row, int):
            return False
        i = bisect_right(self._starts, row) - 1
        return i >= 0 and row < self._stops[i]

    def __iter__(self) -> Iterator[int]:
        for a, b in zip(self._starts, self._stops, strict=True):
            yield from range(a, b)

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return f"RowSet.from_ranges({self.ranges()!r})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RowSet):
            return self._starts == other._starts and self._stops == other._stops
        return super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]  # mutable

    @classmethod
    def _from_iterable(cls, it: Iterable[Any]) -> RowSet:  # type: ignore[override]
        return cls(it)

    def copy(self) -> RowSet:
        out = RowSet()
        out._starts, out._stops, out._len = list(self._starts), list(self._stops), self._len
        return out

    # ------------------------------------------------------------------ MutableSet
    def add(self, row: int) -> None:
        if isinstance(row, bool) or not isinstance(row, int) or row < 0:
            raise ValueError(f"a row index is an int >= 0, got {row!r}")
        self.add_range(row, row + 1)

    def add_range(self, start: int, stop: int) -> None:
        """Add the rows ``start <= row < stop``."""
        if start >= stop:
            return
        starts, stops = self._starts, self._stops
        # the first range that could touch [start, stop): its stop >= start
        lo = bisect_right(stops, start - 1)
        hi = lo
        new_start, new_stop = start, stop
        removed = 0
        while hi < len(starts) and starts[hi] <= stop:  # overlapping or adjacent
            new_start = min(new_start, starts[hi])
            new_stop = max(new_stop, stops[hi])
            removed += stops[hi] - starts[hi]
            hi += 1
        starts[lo:hi] = [new_start]
        stops[lo:hi] = [new_stop]
        self._len += (new_stop - new_start) - removed

    def update(self, rows: Iterable[int]) -> None:
        """Add every row of ``rows`` (a :class:`RowSet`'s ranges at once)."""
        if isinstance(rows, RowSet):
            for a, b in zip(rows._starts, rows._stops, strict=True):
                self.add_range(a, b)
        else:
            for row in rows:
                self.add(row)

    def discard(self, row: int) -> None:
        if row not in self:
            return
        i = bisect_right(self._starts, row) - 1
        a, b = self._starts[i], self._stops[i]
        pieces = [(x, y) for x, y in ((a, row), (row + 1, b)) if x < y]
        self._starts[i : i + 1] = [x for x, _ in pieces]
        self._stops[i : i + 1] = [y for _, y in pieces]
        self._len -= 1
