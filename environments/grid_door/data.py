"""grid_door task data: seeded solvable layouts for the key-and-door grid world.

Rows carry the layout at the top level (``grid``: size, walls, key, door, agent start)
and the step limit (``max_steps``); the server builds the episode from them on
``/reset``. The initial input is a system prompt with the rules; the first observation
(text + image) comes from ``/reset``.

Invariants: agent, key and door are on distinct free cells; the key is reachable from
the start without passing the door, and the door from the key (``optimal_steps`` is the
sum of both BFS distances); ``max_steps >= optimal_steps``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

from pydantic import Field

from gymbridge_envs._common import row_rng
from gymbridge_envs.grid_door.game import Cell, shortest_path

ENV_NAME = "grid_door"

SYSTEM_PROMPT = (
    "You control an agent (blue circle, A) in a grid world. Pick up the key (yellow, K) by walking onto it, "
    "then walk onto the door (brown, D) to open it. Walls (#) block you; the door is locked until you hold "
    "the key. Each turn you see the grid as an image and as text. Reply with exactly one action per turn: "
    "<action>up</action>, <action>down</action>, <action>left</action> or <action>right</action>."
)


MAX_TURNS = 4
"""Model calls an episode may take (a run's ``rollout.max_turns`` when it sets none)."""
SMOKE_PARAMS: dict[str, Any] = {"size": 4}
"""Generator parameters of ``gymbridge smoke run --env grid_door`` (small, for the tiny model)."""


def make_row(
    seed: int,
    index: int,
    *,
    size: Annotated[int, Field(ge=3, le=32)] = 5,
    max_walls: Annotated[int, Field(ge=0)] = 4,
    step_slack: Annotated[int, Field(ge=0)] = 6,
) -> dict[str, Any]:
    """Row ``index`` of the dataset generated with ``seed``."""
    if size < 3:
        raise ValueError("grid_door needs size >= 3")
    rng = row_rng(ENV_NAME, seed, index)
    cells: list[Cell] = [(r, c) for r in range(size) for c in range(size)]
    for _attempt in range(1000):
        picked = rng.sample(cells, 3 + rng.randint(0, max_walls))
        agent, key, door, walls = picked[0], picked[1], picked[2], sorted(picked[3:])
        to_key = shortest_path(size, walls, agent, key, blocked=[door])
        to_door = shortest_path(size, walls, key, door)
        if to_key is not None and to_door is not None:
            break
    else:  # pragma: no cover - practically unreachable for size >= 3
        raise ValueError("could not sample a solvable layout")
    optimal = to_key + to_door
    return {
        "responses_create_params": {
            "input": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": "Open the door. Here is the grid."},
            ],
        },
        "grid": {
            "size": size,
            "walls": [list(w) for w in walls],
            "key": list(key),
            "door": list(door),
            "agent": list(agent),
        },
        "optimal_steps": optimal,
        "max_steps": optimal + step_slack,
    }


def generate(n: int, seed: int = 0, **params: Any) -> Iterator[dict[str, Any]]:
    for index in range(n):
        yield make_row(seed, index, **params)
