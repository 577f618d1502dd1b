"""The bridge: dataset rows -> G rollouts per prompt -> ``TrainBatch`` es.

Public API (stable): :class:`BridgeIterator` (sync and async iteration; :meth:`~BridgeIterator.next_batch`
gives each batch with what a step reports, a :class:`BridgeBatch`, its :class:`BatchTimings` included),
its settings :class:`BridgeConfig`, :class:`BridgeStats`,
:class:`BridgeStalledError`, the rollout sources :class:`GymRollouts` (agent ``/run``) and
:class:`NativeRollouts` (``run_episode``), :class:`RolloutRecord`; :class:`RowReferencer` (media by reference:
a prompt's inline media stored once, the G rows carry references); toy shaping and seeds:
:class:`TokenRateShaping` / :class:`ShapingConfig` (a ``reward_fn``),
:func:`rollout_seed`, :class:`PromptSeededGenerator` (re-exported from :mod:`gymbridge.generation.seeding`).
See ``docs/bridge.md``.
"""

from __future__ import annotations

from gymbridge.bridge.byref import RowReferencer
from gymbridge.bridge.config import BridgeConfig
from gymbridge.bridge.iterator import (
    BatchTimings,
    BridgeBatch,
    BridgeIterator,
    BridgeStalledError,
    BridgeStats,
    GroupResult,
    read_rows,
)
from gymbridge.bridge.shaping import ShapingConfig, TokenRateShaping
from gymbridge.bridge.sources import GymRollouts, NativeRollouts, RolloutRecord, RolloutSource, indexed_rows
from gymbridge.generation.seeding import PromptSeededGenerator, rollout_seed

__all__ = [
    "BatchTimings",
    "BridgeBatch",
    "BridgeConfig",
    "BridgeIterator",
    "BridgeStalledError",
    "BridgeStats",
    "GroupResult",
    "GymRollouts",
    "NativeRollouts",
    "PromptSeededGenerator",
    "RolloutRecord",
    "RolloutSource",
    "RowReferencer",
    "ShapingConfig",
    "TokenRateShaping",
    "indexed_rows",
    "read_rows",
    "rollout_seed",
]
