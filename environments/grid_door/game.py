"""grid_door game logic: the grid world, its transition function, and its renderings.

A ``size`` x ``size`` grid holds walls, a key, a locked door and the agent. Moving onto
the key picks it up; moving onto the door with the key opens it (reward 1.0, episode
terminated); without the key the door blocks like a wall. Each step, valid or not,
counts toward ``max_steps``; reaching it without opening the door truncates the episode.

Invariants: the agent never stands on a wall or on the closed door; ``reward`` is 1.0 on
exactly the step that opens the door and 0.0 on every other step (so the sum over an
episode is 1.0 on success, 0.0 otherwise); after ``terminated`` or ``truncated`` no
further step is accepted (``GameOver``); rendering is a pure function of the state.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from PIL import Image, ImageDraw

Cell = tuple[int, int]  # (row, col)
Action = Literal["up", "down", "left", "right"]
ACTIONS: dict[str, Cell] = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
_ACTION_NAMES: dict[str, Action] = {"up": "up", "down": "down", "left": "left", "right": "right"}

_ACTION_TAG = re.compile(r"<action>\s*([A-Za-z]+)\s*</action>", re.IGNORECASE)

CELL_PX = 32
COLORS = {
    "floor": (236, 236, 228),
    "grid": (200, 200, 192),
    "wall": (70, 70, 78),
    "key": (235, 190, 30),
    "door": (140, 82, 40),
    "agent": (40, 110, 220),
}


class GameOver(RuntimeError):
    """A step was requested after the episode ended."""


def parse_action(text: str) -> Action | None:
    """The last ``<action>X</action>`` of ``text`` when X is a known action, else ``None``."""
    found = _ACTION_TAG.findall(text)
    if not found:
        return None
    return _ACTION_NAMES.get(found[-1].lower())


def _cell(value: Any) -> Cell:
    return int(value[0]), int(value[1])


def _bfs_moves(size: int, obstacles: set[Cell], start: Cell, goal: Cell) -> list[Action] | None:
    """Actions of a shortest path from ``start`` to ``goal`` (BFS, fixed action order); ``None`` if none."""
    parents: dict[Cell, tuple[Cell, Action] | None] = {start: None}
    queue: deque[Cell] = deque([start])
    while queue:
        cur = queue.popleft()
        if cur == goal:
            moves: list[Action] = []
            while (link := parents[cur]) is not None:
                cur, action = link
                moves.append(action)
            return moves[::-1]
        for name, (dr, dc) in ACTIONS.items():
            nxt = (cur[0] + dr, cur[1] + dc)
            if 0 <= nxt[0] < size and 0 <= nxt[1] < size and nxt not in obstacles and nxt not in parents:
                parents[nxt] = (cur, _ACTION_NAMES[name])
                queue.append(nxt)
    return None


def shortest_path(
    size: int, walls: Iterable[Cell], start: Cell, goal: Cell, blocked: Iterable[Cell] = ()
) -> int | None:
    """BFS moves from ``start`` to ``goal`` avoiding walls and ``blocked``; ``None`` if unreachable."""
    moves = _bfs_moves(size, set(walls) | set(blocked), start, goal)
    return None if moves is None else len(moves)


def optimal_actions(layout: dict[str, Any]) -> list[Action]:
    """A shortest action sequence that fetches the key and opens the door (reference solver)."""
    size = int(layout["size"])
    walls = {_cell(w) for w in layout["walls"]}
    agent, key, door = _cell(layout["agent"]), _cell(layout["key"]), _cell(layout["door"])
    to_key = _bfs_moves(size, walls | {door}, agent, key)
    to_door = _bfs_moves(size, walls, key, door)
    if to_key is None or to_door is None:
        raise ValueError("layout is not solvable")
    return to_key + to_door


@dataclass
class GridState:
    """One episode's mutable state."""

    size: int
    walls: frozenset[Cell]
    key: Cell
    door: Cell
    agent: Cell
    max_steps: int
    has_key: bool = False
    steps: int = 0
    terminated: bool = False
    truncated: bool = False
    last_event: str = "The episode starts."
    history: list[str] = field(default_factory=list)

    @classmethod
    def from_layout(cls, layout: dict[str, Any], max_steps: int) -> GridState:
        """Build from a row's ``grid`` dict (``size``, ``walls``, ``key``, ``door``, ``agent``)."""

        return cls(
            size=int(layout["size"]),
            walls=frozenset(_cell(w) for w in layout["walls"]),
            key=_cell(layout["key"]),
            door=_cell(layout["door"]),
            agent=_cell(layout["agent"]),
            max_steps=int(max_steps),
        )

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated

    def step(self, action: Action | None) -> float:
        """Apply ``action`` (``None``: an invalid answer, which still costs a step); return the reward."""
        if self.done:
            raise GameOver("the episode is over; call reset to start a new one")
        reward = 0.0
        if action is None:
            self.last_event = (
                "Invalid action. Answer with exactly one of <action>up</action>, <action>down</action>, "
                "<action>left</action>, <action>right</action>."
            )
        else:
            dr, dc = ACTIONS[action]
            nxt = (self.agent[0] + dr, self.agent[1] + dc)
            inside = 0 <= nxt[0] < self.size and 0 <= nxt[1] < self.size
            if not inside or nxt in self.walls:
                self.last_event = f"You moved {action} and bumped into a wall."
            elif nxt == self.door and not self.has_key:
                self.last_event = f"You moved {action}, but the door is locked. Find the key first."
            elif nxt == self.door:
                self.agent = nxt
                self.terminated = True
                reward = 1.0
                self.last_event = f"You moved {action} and opened the door with the key. You win!"
            else:
                self.agent = nxt
                if nxt == self.key and not self.has_key:
                    self.has_key = True
                    self.last_event = f"You moved {action} and picked up the key."
                else:
                    self.last_event = f"You moved {action}."
        self.steps += 1
        self.history.append(action or "invalid")
        if not self.terminated and self.steps >= self.max_steps:
            self.truncated = True
            self.last_event += f" Step limit ({self.max_steps}) reached."
        return reward

    def ascii(self) -> str:
        rows = []
        for r in range(self.size):
            line = []
            for c in range(self.size):
                cell = (r, c)
                if cell == self.agent:
                    line.append("A")
                elif cell in self.walls:
                    line.append("#")
                elif cell == self.door:
                    line.append("D")
                elif cell == self.key and not self.has_key:
                    line.append("K")
                else:
                    line.append(".")
            rows.append("".join(line))
        return "\n".join(rows)

    def observation_text(self) -> str:
        """The text observation (what a text-only agent sees)."""
        return (
            f"{self.last_event}\n"
            f"Step {self.steps}/{self.max_steps}. You have the key: {'yes' if self.has_key else 'no'}.\n"
            f"{self.ascii()}\n"
            "Legend: A you, K key, D door, # wall, . floor (row 0 is the top). "
            "Reply with one action: <action>up</action>, <action>down</action>, <action>left</action> or "
            "<action>right</action>."
        )

    def render(self) -> Image.Image:
        """The grid as an RGB image, ``CELL_PX`` pixels per cell."""
        px = self.size * CELL_PX
        img = Image.new("RGB", (px, px), COLORS["floor"])
        draw = ImageDraw.Draw(img)
        for r in range(self.size):
            for c in range(self.size):
                x0, y0 = c * CELL_PX, r * CELL_PX
                box = (x0, y0, x0 + CELL_PX - 1, y0 + CELL_PX - 1)
                if (r, c) in self.walls:
                    draw.rectangle(box, fill=COLORS["wall"])
                else:
                    draw.rectangle(box, outline=COLORS["grid"])
        dr, dc = self.door
        draw.rectangle(
            (dc * CELL_PX + 5, dr * CELL_PX + 2, dc * CELL_PX + CELL_PX - 6, dr * CELL_PX + CELL_PX - 1),
            fill=COLORS["door"],
        )
        draw.ellipse(
            (dc * CELL_PX + 20, dr * CELL_PX + 15, dc * CELL_PX + 23, dr * CELL_PX + 18), fill=COLORS["key"]
        )
        if not self.has_key:
            kr, kc = self.key
            x0, y0 = kc * CELL_PX, kr * CELL_PX
            draw.ellipse((x0 + 6, y0 + 10, x0 + 16, y0 + 20), outline=COLORS["key"], width=3)
            draw.rectangle((x0 + 15, y0 + 14, x0 + 27, y0 + 16), fill=COLORS["key"])
            draw.rectangle((x0 + 23, y0 + 16, x0 + 25, y0 + 21), fill=COLORS["key"])
        ar, ac = self.agent
        x0, y0 = ac * CELL_PX, ar * CELL_PX
        draw.ellipse((x0 + 6, y0 + 6, x0 + CELL_PX - 7, y0 + CELL_PX - 7), fill=COLORS["agent"])
        if self.has_key:
            draw.ellipse((x0 + 12, y0 + 12, x0 + 19, y0 + 19), fill=COLORS["key"])
        return img
