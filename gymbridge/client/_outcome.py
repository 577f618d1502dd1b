"""RolloutOutcome: the one record every dataset row yields, success or failure.

Invariants: ``ok`` is True exactly when ``result`` is set and ``kind`` is None;
a failure has ``kind`` in ``{"infra", "data", "timeout", "env_session_lost", "generator_lost"}``
and a non-empty ``reason``; ``attempts`` counts the HTTP attempts made (0 when the row was
rejected before any call).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["FailureKind", "RolloutOutcome"]

FailureKind = Literal["infra", "data", "timeout", "env_session_lost", "generator_lost"]
"""``infra``: transport, 5xx, 408, 429, an environment fault mid-episode the agent reported in a
masked result (``gymbridge.faults``; retried, then given up); ``data``: other 4xx,
malformed results, rows nested too deep, unroutable rows (not retried); ``timeout``: the
deadline passed; ``env_session_lost``: the environment no longer knew the rollout's session
(it restarted or evicted it; the agent answered 409 ``X-Gymbridge-Error: env_session_lost``);
``generator_lost``: the generator fleet lost a model call (its replica died and no healthy replica
could take it; the agent answered 503 ``X-Gymbridge-Error: generator_lost``, not retried)."""


@dataclass(frozen=True, slots=True)
class RolloutOutcome:
    """What ``GymClient.run`` returns for one row."""

    index: int
    """Position of the row in the input of ``run_many`` (0 for a single ``run``)."""
    row: dict[str, Any]
    result: dict[str, Any] | None = None
    """The agent's verify result (row echo + ``response`` + ``reward``) on success."""
    kind: FailureKind | None = None
    reason: str | None = None
    attempts: int = 0
    elapsed_s: float = 0.0
    agent_url: str | None = None
    status: int | None = None
    """The last HTTP status seen (None when no answer came); for an environment fault, the status
    the environment answered the agent (None when it broke the connection or timed out)."""

    def __post_init__(self) -> None:
        if (self.result is None) == (self.kind is None):
            raise ValueError("a RolloutOutcome is either a success (result) or a failure (kind), not both")

    @property
    def ok(self) -> bool:
        return self.result is not None

    @property
    def reward(self) -> float | None:
        if self.result is None:
            return None
        return float(self.result["reward"])

    def failure_record(self) -> dict[str, Any]:
        """The jsonl record of a failure: class, reason, attempts and the row itself."""
        return {
            "index": self.index,
            "kind": self.kind,
            "reason": self.reason,
            "attempts": self.attempts,
            "status": self.status,
            "elapsed_s": round(self.elapsed_s, 4),
            "agent_url": self.agent_url,
            "row": self.row,
        }
