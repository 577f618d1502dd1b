"""Oracle scripts: for a row of one of gymbridge's environments, the scripted-model replies that solve it.

Role: lets a genuine NeMo Gym agent (which knows nothing of our environments) drive each of our
environments to reward 1.0 with gymbridge's ``ScriptedModelServer`` as the policy. Each oracle
reads only the row's top-level task data (what the verifier reads), never server internals.

Invariants: an oracle's script is a plain list of ``ScriptedModelServer`` entries (entry k answers
model call k); tool-style scripts end with a final assistant message so the agent stops on its
own; the gymnasium script (grid_door) is one ``<action>X</action>`` message per step along a
shortest path (key first, then the door), computed here by BFS.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

Row = dict[str, Any]
Script = list[Any]
Cell = tuple[int, int]

MOVES: dict[str, Cell] = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}


def call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"calls": [{"name": name, "arguments": arguments}]}


def counter(row: Row) -> Script:
    steps: Script = [call("increment_counter", count=k) for k in row["increments"]]
    return [*steps, call("get_counter_value"), f"The count is {row['expected_count']}."]


def circle_click(row: Row) -> Script:
    target = next(c for c in row["circles"] if c["color"] == row["target_color"])
    return [call("click", x=int(target["x"]), y=int(target["y"])), "Clicked."]


def beep_count(row: Row) -> Script:
    return [call("answer", count=int(row["num_beeps"])), "Answered."]


def bouncing_ball(row: Row) -> Script:
    return [call("answer", count=int(row["num_bounces"])), "Answered."]


def zoom_read(row: Row) -> Script:
    from gymbridge_envs.zoom_read.data import target_bbox

    bbox = [int(v) for v in target_bbox(row["scene"])]
    return [call("zoom", bbox=bbox), call("answer", value=str(row["target_value"])), "Done."]


def _bfs(size: int, blocked: set[Cell], start: Cell, goal: Cell) -> list[str]:
    prev: dict[Cell, tuple[Cell, str] | None] = {start: None}
    queue: deque[Cell] = deque([start])
    while queue:
        cur = queue.popleft()
        if cur == goal:
            break
        for name, (dr, dc) in MOVES.items():
            nxt = (cur[0] + dr, cur[1] + dc)
            if not (0 <= nxt[0] < size and 0 <= nxt[1] < size) or nxt in blocked or nxt in prev:
                continue
            if nxt != goal and nxt in blocked:
                continue
            prev[nxt] = (cur, name)
            queue.append(nxt)
    if goal not in prev:
        raise ValueError(f"grid_door oracle: {goal} unreachable from {start}")
    path: list[str] = []
    node = goal
    while (step := prev[node]) is not None:
        node, name = step
        path.append(name)
    return path[::-1]


def grid_door_actions(row: Row) -> list[str]:
    grid = row["grid"]
    size = int(grid["size"])
    walls = {(int(r), int(c)) for r, c in grid["walls"]}
    key = (int(grid["key"][0]), int(grid["key"][1]))
    door = (int(grid["door"][0]), int(grid["door"][1]))
    agent = (int(grid["agent"][0]), int(grid["agent"][1]))
    # the closed door blocks like a wall until the key is held
    return _bfs(size, walls | {door}, agent, key) + _bfs(size, walls, key, door)


def grid_door(row: Row) -> Script:
    return [f"I move {a}. <action>{a}</action>" for a in grid_door_actions(row)]


TOOL_ORACLES: dict[str, Callable[[Row], Script]] = {
    "counter": counter,
    "circle_click": circle_click,
    "beep_count": beep_count,
    "bouncing_ball": bouncing_ball,
    "zoom_read": zoom_read,
}
GYMNASIUM_ORACLES: dict[str, Callable[[Row], Script]] = {"grid_door": grid_door}
