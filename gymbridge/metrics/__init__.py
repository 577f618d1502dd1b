"""Payload metrics: bytes crossing each named boundary (docs/design.md, "Payload boundaries").

See :mod:`.payload`.
"""

from __future__ import annotations

from gymbridge.metrics.payload import BOUNDARIES, BoundaryTotals, PayloadMeter, PayloadStats, payload_stats

__all__ = ["BOUNDARIES", "BoundaryTotals", "PayloadMeter", "PayloadStats", "payload_stats"]
