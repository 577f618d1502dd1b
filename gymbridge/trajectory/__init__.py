"""Gym results -> per-turn trainable segments, and the refresh rule for native rollouts.

Public API (stable):

* :func:`from_gym_result` — one ``/run`` result -> :class:`Trajectory` (one walk,
  one trainable predicate, per-turn media index; see ``postprocess``);
* :class:`Trajectory`, :class:`Turn` — the data model and its invariants (``types``);
* :func:`check_media_placeholders` — each turn's media match the placeholder tokens
  of its prompt delta (``checks``);
* :class:`ConversationHistory`, :func:`build_generation_input` -> :class:`GenerationInput`
  — the one prompt builder every generation backend uses (``refresh``).
"""

from __future__ import annotations

from gymbridge.trajectory.checks import PlaceholderCount, check_media_placeholders, count_placeholders
from gymbridge.trajectory.postprocess import REWARD_SUM_TOLERANCE, OnNoncontiguous, from_gym_result
from gymbridge.trajectory.refresh import ConversationHistory, build_generation_input
from gymbridge.trajectory.types import GenerationInput, Trajectory, Turn, TurnKind

__all__ = [
    "REWARD_SUM_TOLERANCE",
    "ConversationHistory",
    "GenerationInput",
    "OnNoncontiguous",
    "PlaceholderCount",
    "Trajectory",
    "Turn",
    "TurnKind",
    "build_generation_input",
    "check_media_placeholders",
    "count_placeholders",
    "from_gym_result",
]
