"""grid_door resources server (gymnasium style): ``/reset`` and ``/step`` with an image every turn.

``/reset`` builds the episode from the row's ``grid`` and ``max_steps`` and answers the
first observation; each ``/step`` reads one action from this turn's assistant text
(the last ``<action>X</action>``), applies it, and answers the next observation. Every
observation is a text rendering (``observation``: what the stock gymnasium_agent
appends as a user message) plus ``observation_content``: the grid as an
``input_image`` PNG followed by the same text (what gymbridge's agent appends).

``/verify`` is also served, for agents that verify at the end: it replays the
rollout's turns (each run of assistant items between two observations is one turn)
from the row's layout, so its reward equals the sum of the step rewards.

Invariants: a step before ``/reset`` or after the episode ended answers 409; the
session's episode is released when it terminates or truncates (SDK rule); the step
limit bounds every episode, whatever the agent's own ``max_steps``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gymbridge.server import (
    HttpError,
    Observation,
    ResourcesServer,
    Session,
    StepResult,
    VerifyResult,
    image_part,
)
from gymbridge_envs._common import assistant_text, png_bytes
from gymbridge_envs._server_common import parse_task, require_state
from gymbridge_envs.grid_door.game import GameOver, GridState, parse_action

__all__ = ["GridDoorServer", "replay_turns", "split_turns"]

_ASSISTANT_TYPES = frozenset({"message", "reasoning", "function_call"})


class Layout(BaseModel):
    size: int = Field(ge=2, le=32)
    walls: list[list[int]] = Field(default_factory=list)
    key: list[int] = Field(min_length=2, max_length=2)
    door: list[int] = Field(min_length=2, max_length=2)
    agent: list[int] = Field(min_length=2, max_length=2)


class GridDoorTask(BaseModel):
    model_config = ConfigDict(extra="ignore")
    grid: Layout
    max_steps: int = Field(ge=1, le=1000)


def _is_assistant(item: Mapping[str, Any]) -> bool:
    kind = item.get("type", "message")
    if kind not in _ASSISTANT_TYPES:
        return False
    return kind != "message" or bool(item.get("role", "assistant") == "assistant")


def split_turns(output: list[Any]) -> list[list[Mapping[str, Any]]]:
    """The rollout's model turns: maximal runs of assistant items between environment items."""
    turns: list[list[Mapping[str, Any]]] = []
    current: list[Mapping[str, Any]] = []
    for item in output:
        if isinstance(item, Mapping) and _is_assistant(item):
            current.append(item)
        elif current:
            turns.append(current)
            current = []
    if current:
        turns.append(current)
    return turns


def replay_turns(task: GridDoorTask, output: list[Any]) -> GridState:
    """The episode state after replaying every turn of ``output`` (stops at the episode's end)."""
    state = GridState.from_layout(task.grid.model_dump(), task.max_steps)
    for turn in split_turns(output):
        if state.done:
            break
        state.step(parse_action(assistant_text(list(turn))))
    return state


def _observation(state: GridState, info: dict[str, Any] | None = None) -> Observation:
    text = state.observation_text()
    return Observation(
        text=text,
        content=[image_part(png_bytes(state.render())), {"type": "input_text", "text": text}],
        info=info or {},
    )


class GridDoorServer(ResourcesServer):
    """Walk to the key, then to the door, one action per turn."""

    async def reset(self, session: Session, row: dict[str, Any]) -> Observation:
        task = parse_task(row, GridDoorTask)
        state = GridState.from_layout(task.grid.model_dump(), task.max_steps)
        session.state["game"] = state
        return _observation(state, {"max_steps": state.max_steps, "grid_size": state.size})

    async def step(self, session: Session, row: dict[str, Any], response: dict[str, Any]) -> StepResult:
        state: GridState = require_state(session, "game", "POST /reset with the row first")
        action = parse_action(assistant_text(response.get("output")))
        try:
            reward = state.step(action)
        except GameOver as exc:
            raise HttpError(409, {"detail": str(exc)}) from None
        info = {
            "action": action,
            "valid_action": action is not None,
            "steps": state.steps,
            "has_key": state.has_key,
        }
        return StepResult(
            observation=_observation(state),
            reward=reward,
            terminated=state.terminated,
            truncated=state.truncated,
            info=info,
        )

    async def close(self, session: Session) -> None:
        session.state.pop("game", None)

    async def verify(self, session: Session, row: dict[str, Any], response: dict[str, Any]) -> VerifyResult:
        task = parse_task(row, GridDoorTask)
        state = replay_turns(task, response["output"])
        return VerifyResult(
            reward=1.0 if state.terminated else 0.0,
            extra={"steps": state.steps, "has_key": state.has_key, "actions": state.history},
        )
