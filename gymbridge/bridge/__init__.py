"""The bridge: dataset rows -> G rollouts per prompt -> ``TrainBatch`` es, plus a replay buffer.

Public API (stable): :class:`BridgeIterator` (sync and async iteration), :class:`BridgeStats`,
:class:`BridgeStalledError`, the rollout sources :class:`GymRollouts` (agent ``/run``) and
:class:`NativeRollouts` (``run_episode``), :class:`RolloutRecord`, :class:`ReplayBuffer`
(atomic checkpoints) and :func:`write_atomic`. See ``docs/bridge.md``.
"""

from __future__ import annotations

from gymbridge.bridge.iterator import BridgeIterator, BridgeStalledError, BridgeStats, GroupResult, read_rows
from gymbridge.bridge.replay import ReplayBuffer, ReplayCheckpointError, write_atomic
from gymbridge.bridge.sources import GymRollouts, NativeRollouts, RolloutRecord, RolloutSource, indexed_rows

__all__ = [
    "BridgeIterator",
    "BridgeStalledError",
    "BridgeStats",
    "GroupResult",
    "GymRollouts",
    "NativeRollouts",
    "ReplayBuffer",
    "ReplayCheckpointError",
    "RolloutRecord",
    "RolloutSource",
    "indexed_rows",
    "read_rows",
    "write_atomic",
]
