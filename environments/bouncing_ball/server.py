"""bouncing_ball resources server: count the ball's bounces in an MP4; reward 1.0 when exact.

Same answer rules as beep_count: the first ``answer(count)`` call, else the assistant's
text (``<answer>N</answer>``, else the last integer). Stateless: the video is in the row.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from gymbridge.server import ResourcesServer, Session, VerifyResult, tool
from gymbridge_envs._common import count_reward, parse_int_answer
from gymbridge_envs._server_common import parse_task

__all__ = ["BouncingBallServer"]


class BouncingBallTask(BaseModel):
    model_config = ConfigDict(extra="ignore")
    num_bounces: int = Field(ge=0)


class BouncingBallServer(ResourcesServer):
    """How many times does the ball bounce?"""

    @tool
    async def answer(
        self, count: Annotated[int, Field(description="the number of times the ball bounced off a wall")]
    ) -> dict[str, Any]:
        """Give the number of bounces you saw. Ends the task."""
        return {"recorded": count, "done": True}

    async def verify(self, session: Session, row: dict[str, Any], response: dict[str, Any]) -> VerifyResult:
        task = parse_task(row, BouncingBallTask)
        answered = parse_int_answer(response["output"], tool="answer", arg="count")
        return VerifyResult(reward=count_reward(task.num_bounces, answered), extra={"answered": answered})
