"""Payload metrics (bytes crossing each named boundary, docs/design.md "Payload boundaries") and
phase timers (seconds per named phase, docs/timing.md).

See :mod:`.payload` and :mod:`.timing`.
"""

from __future__ import annotations

from gymbridge.metrics.payload import BOUNDARIES, BoundaryTotals, PayloadMeter, PayloadStats, payload_stats
from gymbridge.metrics.timing import PhaseTimer, timing_delta

__all__ = [
    "BOUNDARIES",
    "BoundaryTotals",
    "PayloadMeter",
    "PayloadStats",
    "PhaseTimer",
    "payload_stats",
    "timing_delta",
]
