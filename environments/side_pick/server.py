"""side_pick resources server: reward 1.0 when the answer is the letter of the bar's side.

``verify`` reads the assistant's final text (its first word, see
:func:`gymbridge_envs.side_pick.data.answer_of`). The server publishes no tool: the image is
in the prompt. A row without a valid ``side`` is refused with 422.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from gymbridge.server import ResourcesServer, Session, VerifyResult
from gymbridge_envs._common import assistant_text
from gymbridge_envs._server_common import parse_task
from gymbridge_envs.side_pick.data import side_reward

__all__ = ["SidePickServer"]


class SidePickTask(BaseModel):
    model_config = ConfigDict(extra="ignore")
    side: Literal["T", "B", "L", "R"]


class SidePickServer(ResourcesServer):
    """Name the side (T, B, L, R) of the image the bar lies along."""

    async def seed_session(self, session: Session, row: dict[str, Any]) -> dict[str, Any]:
        session.state["task"] = parse_task(row, SidePickTask).model_dump()
        return {}

    async def verify(self, session: Session, row: dict[str, Any], response: dict[str, Any]) -> VerifyResult:
        task = parse_task(row, SidePickTask)
        text = assistant_text(response.get("output"))
        return VerifyResult(reward=side_reward(task.side, text), extra={"answer": text[:64]})
