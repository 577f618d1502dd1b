"""circle_click resources server: one ``click(x, y)`` tool; reward 1.0 inside the target circle.

Protocol parity with stock Gym's circle_click: the tool echoes the click, ``verify``
scores the **first** ``click`` call of the rollout (later clicks do not count) and adds
``clicked_x``, ``clicked_y`` and ``hit`` to the verify response. Unlike stock Gym, a row
without ``circles`` / ``target_color`` is refused (422) rather than scored 0.0.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from gymbridge.server import ResourcesServer, Session, VerifyResult, tool
from gymbridge_envs._common import first_call_arguments
from gymbridge_envs._server_common import parse_task
from gymbridge_envs.circle_click.data import click_reward, parse_click

__all__ = ["CircleClickServer"]


class Circle(BaseModel):
    x: float
    y: float
    radius: float = Field(gt=0)
    color: str


class CircleClickTask(BaseModel):
    model_config = ConfigDict(extra="ignore")
    circles: list[Circle] = Field(min_length=1)
    target_color: str


class CircleClickServer(ResourcesServer):
    """Click the centre of the circle of the requested colour."""

    @tool
    async def click(
        self,
        x: Annotated[int, Field(description="X pixel coordinate (a single integer)")],
        y: Annotated[int, Field(description="Y pixel coordinate (a single integer)")],
    ) -> dict[str, int]:
        """Click at pixel coordinates (x, y) in the image. Both x and y must be single integers."""
        return {"x": x, "y": y}

    async def verify(self, session: Session, row: dict[str, Any], response: dict[str, Any]) -> VerifyResult:
        task = parse_task(row, CircleClickTask)
        x, y = parse_click(first_call_arguments(response["output"], "click"))
        circles = [c.model_dump() for c in task.circles]
        reward = click_reward(circles, task.target_color, x, y)
        return VerifyResult(reward=reward, extra={"clicked_x": x, "clicked_y": y, "hit": reward == 1.0})
