"""Deduplicated tensors: ``PackedTensor`` (CSR rows of shared segments), ``TrainBatch``, ``MediaProcessor``.

Media of a GRPO group exist once from G-expansion to the DP shards; see
``docs/design.md`` ("Deduplicated tensors") and each module's docstring for the invariants.
"""

from __future__ import annotations

from gymbridge.tensors.batch import AdvantageMode, TrainBatch, group_advantages
from gymbridge.tensors.packed import IndexLike, PackedTensor, derive_provenance, new_provenance
from gymbridge.tensors.processor import MediaLike, MediaProcessor, ProcessedMedia, ProcessorStats

__all__ = [
    "AdvantageMode",
    "IndexLike",
    "MediaLike",
    "MediaProcessor",
    "PackedTensor",
    "ProcessedMedia",
    "ProcessorStats",
    "TrainBatch",
    "derive_provenance",
    "group_advantages",
    "new_provenance",
]
