"""Test helpers for the example environments: output builders, oracle scripts, a loopback server.

Used by ``environments/*/tests``; also handy when scripting a rollout by hand. Builders
produce items in the exact stock Gym JSON shapes (``function_call`` with a JSON-string
``arguments``, assistant ``message`` with ``output_text`` parts). :func:`oracle_script`
gives, for a row, the ``ScriptedModelServer`` script that solves it (reward 1.0), reading
only the row's top-level task data. :func:`running` starts a server on a free 127.0.0.1
port in the current event loop and always stops it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from gymbridge.server import GymServer, start_server

__all__ = ["call", "call_output", "message", "oracle_script", "response", "running", "user"]

JsonDict = dict[str, Any]


def call(name: str, arguments: Any, call_id: str | None = None) -> JsonDict:
    """A ``function_call`` item (``arguments`` JSON-encoded unless already a string)."""
    cid = call_id or f"call_{uuid.uuid4().hex[:10]}"
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {
        "type": "function_call",
        "id": cid,
        "call_id": cid,
        "name": name,
        "arguments": args,
        "status": "completed",
    }


def call_output(call_id: str, output: Any) -> JsonDict:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def message(text: str) -> JsonDict:
    """An assistant ``message`` item."""
    return {
        "type": "message",
        "id": f"msg_{uuid.uuid4().hex[:10]}",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def user(text: str) -> JsonDict:
    """An injected user message (an observation)."""
    return {"type": "message", "role": "user", "content": text}


def response(*items: JsonDict) -> JsonDict:
    """A Responses object holding ``items`` as its output."""
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": 0.0,
        "model": "test",
        "output": list(items),
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }


@asynccontextmanager
async def running(server: GymServer) -> AsyncIterator[str]:
    """Serve ``server`` on a free loopback port; yield its base URL; stop it on exit."""
    handle = await start_server(server, host="127.0.0.1", port=0)
    try:
        yield handle.url
    finally:
        await handle.stop()


def _calls(name: str, **arguments: Any) -> JsonDict:
    return {"calls": [{"name": name, "arguments": arguments}]}


def oracle_script(env: str, row: dict[str, Any], *, zooms: int = 1) -> list[Any]:
    """The scripted-model replies (entry k answers model call k) that solve ``row`` of ``env``.

    Tool environments end with a plain assistant message so an agent stops on its own;
    grid_door is one ``<action>X</action>`` message per step along a shortest path.
    """
    if env == "color_pick":  # reveal: tool rows look first
        answer = str(row["color"])
        return [_calls("look"), answer] if row.get("reveal") == "tool" else [answer]
    if env == "side_pick":
        return [str(row["side"])]
    if env == "circle_click":
        target = next(c for c in row["circles"] if c["color"] == row["target_color"])
        return [_calls("click", x=int(target["x"]), y=int(target["y"])), "Clicked."]
    if env == "zoom_read":
        from gymbridge_envs.zoom_read.data import target_bbox

        x0, y0, x1, y1 = target_bbox(row["scene"])
        boxes = [[x0 - 8 * k, y0 - 8 * k, x1 + 8 * k, y1 + 8 * k] for k in range(zooms, 0, -1)]
        steps: list[Any] = [_calls("zoom", bbox=b) for b in boxes]
        return [*steps, _calls("answer", value=str(row["target_value"])), "Done."]
    if env == "beep_count":
        return [_calls("answer", count=int(row["num_beeps"])), "Answered."]
    if env == "bouncing_ball":
        return [_calls("answer", count=int(row["num_bounces"])), "Answered."]
    if env == "counter":
        increments: list[Any] = [_calls("increment_counter", count=k) for k in row["increments"]]
        return [*increments, _calls("get_counter_value"), f"The count is {row['expected_count']}."]
    if env == "grid_door":
        from gymbridge_envs.grid_door.game import optimal_actions

        return [f"I move {a}. <action>{a}</action>" for a in optimal_actions(row["grid"])]
    raise ValueError(f"no oracle for environment {env!r}")
