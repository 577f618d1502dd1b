"""Phase timers: cumulative seconds per named phase, readable while the phases run.

A :class:`PhaseTimer` counts, per phase name (``generate``, ``env_verify``, ...), three
monotone totals:

* ``<phase>_s``: seconds summed over every timed interval (concurrent intervals add up, so
  16 rollouts verifying at once for 10 ms count 0.16 s);
* ``<phase>_busy_s``: wall seconds during which at least one interval of the phase was open
  (the union of the intervals: 16 concurrent 10 ms verifies count about 0.01 s). This is the
  number that can sit next to a step's wall time;
* ``<phase>_n``: intervals finished;

and plain counters (:meth:`PhaseTimer.count`: ``generated_tokens``, ``rollouts``) under their
own name. :meth:`PhaseTimer.snapshot` returns them as a flat ``{key: float}``; open intervals count up
to the moment of the snapshot, so every value only ever grows and
:func:`timing_delta` of two snapshots is what happened between them (a step's share).
Components own one timer each (the model server, the agent, the bridge) and expose it
in-process; the model server and the agent also answer it over HTTP (``GET /counters``).

Invariant: safe to use from several threads and from the event loop at once (one lock,
held for a few dictionary updates, never across the timed work).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

__all__ = ["PhaseTimer", "timing_delta"]


class PhaseTimer:
    """Cumulative seconds, busy seconds and counts per phase (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sum_s: dict[str, float] = {}
        self._busy_s: dict[str, float] = {}
        self._count: dict[str, float] = {}
        self._counters: dict[str, float] = {}
        self._open: dict[str, int] = {}
        """Intervals of the phase open now."""
        self._busy_since: dict[str, float] = {}
        """When the phase's current busy stretch began (only while ``_open[phase] > 0``)."""
        self._open_started: dict[int, tuple[str, float]] = {}
        """Start of every open interval, by token (for snapshots mid-interval)."""
        self._next_token = 0

    def start(self, phase: str) -> int:
        """Open an interval of ``phase``; returns the token :meth:`stop` takes."""
        now = time.perf_counter()
        with self._lock:
            self._next_token += 1
            token = self._next_token
            self._open_started[token] = (phase, now)
            opened = self._open.get(phase, 0)
            if opened == 0:
                self._busy_since[phase] = now
            self._open[phase] = opened + 1
        return token

    def stop(self, token: int) -> float:
        """Close the interval ``token``; returns its seconds (0.0 for an unknown or closed token)."""
        now = time.perf_counter()
        with self._lock:
            entry = self._open_started.pop(token, None)
            if entry is None:
                return 0.0
            phase, began = entry
            seconds = now - began
            self._sum_s[phase] = self._sum_s.get(phase, 0.0) + seconds
            self._count[phase] = self._count.get(phase, 0.0) + 1
            left = self._open[phase] - 1
            self._open[phase] = left
            if left == 0:
                self._busy_s[phase] = self._busy_s.get(phase, 0.0) + now - self._busy_since.pop(phase)
        return seconds

    @contextmanager
    def time(self, phase: str) -> Iterator[None]:
        """Time the ``with`` body as one interval of ``phase`` (closed on exceptions too)."""
        token = self.start(phase)
        try:
            yield
        finally:
            self.stop(token)

    def add(self, phase: str, seconds: float) -> None:
        """Add one interval of ``phase`` measured elsewhere (counted as busy time too)."""
        if not seconds >= 0:
            raise ValueError(f"a phase timer only grows: seconds must be >= 0, got {seconds}")
        with self._lock:
            self._sum_s[phase] = self._sum_s.get(phase, 0.0) + seconds
            self._busy_s[phase] = self._busy_s.get(phase, 0.0) + seconds
            self._count[phase] = self._count.get(phase, 0.0) + 1

    def count(self, name: str, n: float = 1) -> None:
        """Add ``n`` (>= 0) to the plain counter ``name`` (its snapshot key is ``name`` itself)."""
        if not n >= 0:
            raise ValueError(f"a counter only grows: n must be >= 0, got {n}")
        with self._lock:
            self._counters[name] = self._counters.get(name, 0.0) + n

    def snapshot(self) -> dict[str, float]:
        """``{<phase>_s, <phase>_busy_s, <phase>_n}`` for every phase seen (open intervals included),
        and every counter."""
        now = time.perf_counter()
        with self._lock:
            sums = dict(self._sum_s)
            busy = dict(self._busy_s)
            counts = dict(self._count)
            counters = dict(self._counters)
            for phase, began in self._open_started.values():
                sums[phase] = sums.get(phase, 0.0) + now - began
            for phase, since in self._busy_since.items():
                busy[phase] = busy.get(phase, 0.0) + now - since
        out: dict[str, float] = {}
        for phase in sorted(set(sums) | set(counts)):
            out[f"{phase}_s"] = sums.get(phase, 0.0)
            out[f"{phase}_busy_s"] = busy.get(phase, 0.0)
            out[f"{phase}_n"] = counts.get(phase, 0.0)
        out.update(counters)
        return out


def timing_delta(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    """``after - before`` key by key (a key missing from ``before`` counts from 0)."""
    return {key: value - before.get(key, 0.0) for key, value in after.items()}
