"""Async Gym client (httpx): discovery, ``/run`` with deadlines and bounded retries, collection.

Public API (stable): :class:`GymClient`, :class:`RolloutOutcome`, ``FailureKind``.
See ``docs/http.md``.
"""

from __future__ import annotations

from gymbridge.client._client import GymClient
from gymbridge.client._discovery import parse_global_config, server_urls
from gymbridge.client._outcome import FailureKind, RolloutOutcome

__all__ = ["FailureKind", "GymClient", "RolloutOutcome", "parse_global_config", "server_urls"]
