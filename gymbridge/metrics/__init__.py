"""Payload metrics (bytes crossing each named boundary, docs/design.md "Payload boundaries") and
phase timers (seconds per named phase, docs/timing.md).

See :mod:`.payload` and :mod:`.timing`. The names load lazily: :mod:`.timing` is torch-free and
the agent and servers of the base install import it, while :mod:`.payload` measures tensors
(``tests/packaging``: the base install imports without torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gymbridge.metrics.payload import (
        BOUNDARIES,
        BoundaryTotals,
        PayloadMeter,
        PayloadStats,
        payload_stats,
    )
    from gymbridge.metrics.timing import PhaseTimer, timing_delta

_WHERE = {
    "BOUNDARIES": "payload",
    "BoundaryTotals": "payload",
    "PayloadMeter": "payload",
    "PayloadStats": "payload",
    "payload_stats": "payload",
    "PhaseTimer": "timing",
    "timing_delta": "timing",
}

__all__ = [
    "BOUNDARIES",
    "BoundaryTotals",
    "PayloadMeter",
    "PayloadStats",
    "PhaseTimer",
    "payload_stats",
    "timing_delta",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'gymbridge.metrics' has no attribute {name!r}")
    return getattr(importlib.import_module(f"gymbridge.metrics.{module}"), name)
