"""The public API of gymbridge.tensors / gymbridge.metrics: flat, sorted, importable."""

from __future__ import annotations

import gymbridge.metrics
import gymbridge.tensors


def test_public_api_is_flat_sorted_and_importable() -> None:
    for module in (gymbridge.tensors, gymbridge.metrics):
        names = module.__all__
        assert names == sorted(names)
        for name in names:
            assert getattr(module, name) is not None
    for stable in ("PackedTensor", "TrainBatch", "MediaProcessor"):
        assert stable in gymbridge.tensors.__all__
    for stable in ("payload_stats", "PayloadMeter"):
        assert stable in gymbridge.metrics.__all__
