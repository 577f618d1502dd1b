"""color_pick resources server: reward 1.0 when the answer names the image's colour.

``verify`` reads the assistant's final text (the first word, see
:func:`gymbridge_envs.color_pick.data.answer_of`). With ``reveal="tool"`` rows the colour is
shown only by ``look``, which answers a :class:`~gymbridge.server.ToolOutput` holding the
solid-colour image (the second model call of the rollout sees it).

Invariant: ``look`` needs a seeded session (409 otherwise) and is answered at most
``max_looks`` times per session (bounded work per rollout).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gymbridge.server import HttpError, ResourcesServer, Session, ToolOutput, VerifyResult, image_part, tool
from gymbridge_envs._common import assistant_text, png_bytes
from gymbridge_envs._server_common import parse_task, require_state
from gymbridge_envs.color_pick.data import COLORS, pick_reward, render

__all__ = ["ColorPickServer"]


class ColorPickTask(BaseModel):
    model_config = ConfigDict(extra="ignore")
    color: str
    img_size: int = Field(56, ge=28, le=448)
    blank: bool = False


class ColorPickServer(ResourcesServer):
    """Name the colour of a solid-colour image."""

    def __init__(self, *, instance_name: str | None = None, max_looks: int = 4) -> None:
        super().__init__(instance_name=instance_name)
        self.max_looks = max_looks

    async def seed_session(self, session: Session, row: dict[str, Any]) -> dict[str, Any]:
        task = parse_task(row, ColorPickTask)
        if task.color not in COLORS:
            raise HttpError(422, {"detail": f"unknown color {task.color!r}; known: {sorted(COLORS)}"})
        session.state.update(task=task.model_dump(), looks=0)
        return {}

    @tool
    async def look(self, session: Session) -> ToolOutput:
        """Show the image whose colour you must name."""
        task = require_state(session, "task", "POST /seed_session with the row first")
        if session.state["looks"] >= self.max_looks:
            raise HttpError(429, {"detail": f"look limit reached ({self.max_looks} per task); answer now"})
        session.state["looks"] += 1
        image = render(task["color"], int(task["img_size"]), blank=bool(task["blank"]))
        return ToolOutput(text="The image:", media=[image_part(png_bytes(image))])

    async def verify(self, session: Session, row: dict[str, Any], response: dict[str, Any]) -> VerifyResult:
        task = parse_task(row, ColorPickTask)
        text = assistant_text(response.get("output"))
        reward = pick_reward(task.color, text)
        return VerifyResult(
            reward=reward, extra={"answer": text[:64], "looks": session.state.get("looks", 0)}
        )
