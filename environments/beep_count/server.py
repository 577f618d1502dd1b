"""beep_count resources server: count the beeps in a WAV clip; reward 1.0 for the exact count.

The answer comes from the first ``answer(count)`` call of the rollout or, without one,
from the assistant's text (``<answer>N</answer>``, else the last integer), so the task
works with and without tool calling. The audio itself is in the row
(``responses_create_params.metadata.audio_data``); the server keeps no state.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from gymbridge.server import ResourcesServer, Session, VerifyResult, tool
from gymbridge_envs._common import count_reward, parse_int_answer
from gymbridge_envs._server_common import parse_task

__all__ = ["BeepCountServer"]


class BeepCountTask(BaseModel):
    model_config = ConfigDict(extra="ignore")
    num_beeps: int = Field(ge=0)


class BeepCountServer(ResourcesServer):
    """How many beeps are in the clip?"""

    @tool
    async def answer(self, count: Annotated[int, Field(description="the number of beeps")]) -> dict[str, Any]:
        """Give the number of beeps you heard. Ends the task."""
        return {"recorded": count, "done": True}

    async def verify(self, session: Session, row: dict[str, Any], response: dict[str, Any]) -> VerifyResult:
        task = parse_task(row, BeepCountTask)
        answered = parse_int_answer(response["output"], tool="answer", arg="count")
        return VerifyResult(reward=count_reward(task.num_beeps, answered), extra={"answered": answered})
