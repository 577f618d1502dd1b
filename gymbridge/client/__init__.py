"""Async Gym client (httpx): discovery, ``/run`` with deadlines and bounded retries, collection.

Public API (stable): :class:`GymClient`, :class:`RolloutOutcome`, ``FailureKind``; a row's
environment, :func:`env_of_row` (its ``agent_ref`` name), and the ``agent_ref`` naming an agent,
:func:`agent_ref`.
See ``docs/http.md``.
"""

from __future__ import annotations

from gymbridge.client._client import GymClient
from gymbridge.client._discovery import agent_ref, env_of_row, parse_global_config, server_urls
from gymbridge.client._outcome import FailureKind, RolloutOutcome

__all__ = [
    "FailureKind",
    "GymClient",
    "RolloutOutcome",
    "agent_ref",
    "env_of_row",
    "parse_global_config",
    "server_urls",
]
