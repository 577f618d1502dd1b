"""Two small environments on the SDK, for tests, benchmarks and as a template.

* :class:`CounterEnv` (tool style): ``increment(amount)`` keeps a count in the
  session; ``snapshot()`` returns a tiny PNG of the count (a tool image);
  ``explode()`` raises (its error body goes back to the model); ``verify``
  pays 1.0 when the final count equals the row's ``target``, split into two
  reward components.
* :class:`StepCounterEnv` (gymnasium style): every observation carries a PNG;
  the model answers ``<action>inc</action>`` or ``<action>stop</action>``;
  the episode terminates on ``stop`` (reward 1 when the count hit ``target``)
  and truncates after ``horizon`` steps.

Rows come from :func:`counter_rows` / :func:`step_counter_rows` (seeded,
deterministic, stock Gym row shape ready for ``POST /run``).
"""

from __future__ import annotations

import io
import random
import re
from typing import Annotated, Any

from pydantic import Field

from gymbridge.server._base import Session
from gymbridge.server._resources import Observation, ResourcesServer, StepResult, VerifyResult
from gymbridge.server._tools import ToolOutput, image_part, tool

__all__ = ["CounterEnv", "StepCounterEnv", "counter_rows", "png_of", "step_counter_rows"]

ACTION = re.compile(r"<action>\s*(\w+)\s*</action>")


def png_of(value: int, size: int = 16) -> bytes:
    """A small deterministic PNG whose colour encodes ``value`` (Pillow)."""
    from PIL import Image

    shade = (value * 37) % 256
    image = Image.new("RGB", (size, size), (shade, 255 - shade, (shade * 7) % 256))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


class CounterEnv(ResourcesServer):
    """Tool-style counter: state lives in the session across tool calls."""

    @tool
    async def increment(
        self,
        session: Session,
        amount: Annotated[int, Field(ge=-100, le=100, description="added to the count")] = 1,
    ) -> dict[str, int]:
        """Add ``amount`` to the counter and return the new count."""
        session.state["count"] = session.state.get("count", 0) + amount
        return {"count": session.state["count"]}

    @tool
    async def snapshot(self, session: Session) -> ToolOutput:
        """Return an image of the current count."""
        count = int(session.state.get("count", 0))
        return ToolOutput(text=f"count is {count}", media=[image_part(png_of(count))])

    @tool
    async def explode(self, reason: str = "boom") -> str:
        """Always fails (exercises error bodies)."""
        raise RuntimeError(reason)

    async def seed_session(self, session: Session, row: dict[str, Any]) -> dict[str, Any] | None:
        session.state["count"] = int(row.get("start", 0))
        return {}

    async def verify(self, session: Session, row: dict[str, Any], response: dict[str, Any]) -> VerifyResult:
        count = int(session.state.get("count", 0))
        hit = count == int(row.get("target", 0))
        answered = any(item.get("type") == "message" for item in response["output"] if isinstance(item, dict))
        return VerifyResult(
            reward=(0.8 if hit else 0.0) + (0.2 if answered else 0.0),
            reward_components={"count": 0.8 if hit else 0.0, "answered": 0.2 if answered else 0.0},
            extra={"final_count": count},
        )


class StepCounterEnv(ResourcesServer):
    """Gymnasium-style counter with an image in every observation."""

    horizon = 6

    async def reset(self, session: Session, row: dict[str, Any]) -> Observation:
        session.state.update(count=0, steps=0)
        return self._observe(session, "reset")

    async def step(self, session: Session, row: dict[str, Any], response: dict[str, Any]) -> StepResult:
        text = " ".join(
            part.get("text", "")
            for item in response.get("output", [])
            if isinstance(item, dict) and item.get("type") == "message"
            for part in item.get("content") or []
            if isinstance(part, dict)
        )
        match = ACTION.search(text)
        action = match.group(1) if match else "invalid"
        session.state["steps"] = session.state.get("steps", 0) + 1
        if action == "inc":
            session.state["count"] = session.state.get("count", 0) + 1
        if action == "stop":
            hit = session.state.get("count", 0) == int(row.get("target", 0))
            return StepResult(self._observe(session, "stopped"), reward=1.0 if hit else 0.0, terminated=True)
        truncated = session.state["steps"] >= self.horizon
        return StepResult(self._observe(session, action), truncated=truncated, info={"action": action})

    def _observe(self, session: Session, event: str) -> Observation:
        count = int(session.state.get("count", 0))
        text = f"{event}: count={count}. Answer <action>inc</action> or <action>stop</action>."
        return Observation(
            text=text, content=[{"type": "input_text", "text": text}, image_part(png_of(count))], info={}
        )


def counter_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` CounterEnv rows (stock Gym row shape) from ``seed``."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        target = rng.randint(1, 3)
        rows.append(
            {
                "responses_create_params": {
                    "input": [
                        {"role": "user", "content": f"Increment the counter to {target}, then say done."}
                    ],
                    "tools": CounterEnv.function_tools(),
                },
                "target": target,
                "_ng_task_index": i,
                "_ng_rollout_index": 0,
                "agent_ref": {"type": "responses_api_agents", "name": "simple_agent"},
            }
        )
    return rows


def step_counter_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` StepCounterEnv rows from ``seed``."""
    rng = random.Random(seed)
    return [
        {
            "responses_create_params": {"input": [{"role": "user", "content": "Count, then stop."}]},
            "target": rng.randint(1, 3),
            "_ng_task_index": i,
            "_ng_rollout_index": 0,
        }
        for i in range(n)
    ]
