"""counter resources server: a per-session counter behind two tools.

``/seed_session`` sets the session's counter to the row's ``initial_count``;
``increment_counter(count)`` adds to it; ``get_counter_value()`` reads it; ``verify``
rewards 1.0 when the session's counter equals ``expected_count``. Same tool names,
argument names and answers as stock Gym's ``example_session_state_mgmt``.

Invariant: state lives only in the caller's session (cookie), so concurrent rollouts
never see each other's counters; ``verify`` on a session that was never seeded scores
0.0 (stock behaviour) and says so in ``failure_kind`` / ``failure_reason``.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from gymbridge.server import ResourcesServer, Session, VerifyResult, tool
from gymbridge_envs._common import count_reward
from gymbridge_envs._server_common import parse_task

__all__ = ["CounterServer"]

COUNT_KEY = "count"


class CounterSeed(BaseModel):
    model_config = ConfigDict(extra="ignore")
    initial_count: int = 0


class CounterTask(BaseModel):
    model_config = ConfigDict(extra="ignore")
    expected_count: int


class CounterServer(ResourcesServer):
    """Add numbers to a counter and read it back."""

    async def seed_session(self, session: Session, row: dict[str, Any]) -> dict[str, Any]:
        seed = parse_task(row, CounterSeed)
        session.state.setdefault(COUNT_KEY, seed.initial_count)
        return {}

    @tool
    async def increment_counter(
        self,
        session: Session,
        count: Annotated[int, Field(description="the amount to add (may be negative)")],
    ) -> dict[str, bool]:
        """Add count to the counter."""
        session.state[COUNT_KEY] = int(session.state.get(COUNT_KEY, 0)) + count
        return {"success": True}

    @tool
    async def get_counter_value(self, session: Session) -> dict[str, int]:
        """Read the counter's current value."""
        return {"count": int(session.state.setdefault(COUNT_KEY, 0))}

    async def verify(self, session: Session, row: dict[str, Any], response: dict[str, Any]) -> VerifyResult:
        task = parse_task(row, CounterTask)
        final = session.state.get(COUNT_KEY)
        reward = count_reward(task.expected_count, final)
        if final is None:
            return VerifyResult(
                reward=reward,
                failure_kind="counter:session_not_seeded",
                failure_reason="no counter in this session: /seed_session was not called with its cookie",
                extra={"final_count": None},
            )
        return VerifyResult(reward=reward, extra={"final_count": final})
