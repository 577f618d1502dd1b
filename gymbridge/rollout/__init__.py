"""Native multi-turn rollouts: the bridge drives a generator and an environment directly.

Public API (stable): :func:`run_episode` (one rollout, the ``/run`` result shape),
:func:`run_group` (G concurrent rollouts of one row, failures recorded as data),
:class:`NativeModel` (one rollout's model side; ``.inputs`` records every
``GenerationInput``).
"""

from __future__ import annotations

from gymbridge.rollout.episode import EpisodeMode, NativeModel, row_sampling, run_episode, run_group

__all__ = ["EpisodeMode", "NativeModel", "row_sampling", "run_episode", "run_group"]
