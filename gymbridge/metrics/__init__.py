"""Payload metrics (bytes crossing each named boundary, docs/design.md "Payload boundaries"),
phase timers (seconds per named phase, docs/timing.md) and pass@k over grouped rollouts (NeMo
Gym's definitions: pass@k, pass@1[avg-of-k], majority@k).

See :mod:`.payload`, :mod:`.timing` and :mod:`.passk`. The names load lazily: :mod:`.timing` and
:mod:`.passk` are torch-free (the agent, the servers and ``gymbridge collect`` of the base install
import them), while :mod:`.payload` measures tensors (``tests/packaging``: the base install
imports without torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gymbridge.metrics.passk import headline, pass_majority_metrics, summary_lines, vote_key
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
    "headline": "passk",
    "pass_majority_metrics": "passk",
    "summary_lines": "passk",
    "vote_key": "passk",
}

__all__ = [
    "BOUNDARIES",
    "BoundaryTotals",
    "PayloadMeter",
    "PayloadStats",
    "PhaseTimer",
    "headline",
    "pass_majority_metrics",
    "payload_stats",
    "summary_lines",
    "timing_delta",
    "vote_key",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'gymbridge.metrics' has no attribute {name!r}")
    return getattr(importlib.import_module(f"gymbridge.metrics.{module}"), name)
