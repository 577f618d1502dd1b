"""End to end: the simple agent's results become Trajectory objects with the right per-turn media."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from gymbridge.server import SimpleAgent, start_server
from gymbridge.server.examples import CounterEnv, StepCounterEnv, counter_rows, png_of, step_counter_rows
from gymbridge.testing.scripted_model import IMAGE_TOKEN_ID, ScriptedModelServer

trajectory = pytest.importorskip("gymbridge.trajectory")


async def _run(env_server: Any, script: list[Any], row: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    env = await start_server(env_server)
    model = ScriptedModelServer(script)
    await model.start()
    agent = await start_server(SimpleAgent(resources_url=env.url, model_url=model.url, **kwargs))
    try:
        async with aiohttp.ClientSession() as http, http.post(agent.url + "/run", json=row) as resp:
            assert resp.status == 200
            result: dict[str, Any] = await resp.json()
            return result
    finally:
        await agent.stop()
        await model.stop()
        await env.stop()


async def test_tool_image_lands_on_the_turn_after_the_call() -> None:
    script = [
        {"calls": [{"name": "increment", "arguments": {}}]},
        {"reasoning": "look", "calls": [{"name": "snapshot", "arguments": {}}]},
        "done",
    ]
    result = await _run(CounterEnv(), script, {**counter_rows(1)[0], "target": 1})
    traj = trajectory.from_gym_result(result, placeholder_token_ids={"image": IMAGE_TOKEN_ID})
    assert [t.kind for t in traj.turns] == ["function_call", "function_call", "message"]
    assert [len(t.media) for t in traj.turns] == [0, 0, 1]
    image = traj.turns[2].media[0]
    assert image.modality == "image" and image.raw == png_of(1)
    assert traj.reward == pytest.approx(1.0)
    assert traj.reward_components == {"count": 0.8, "answered": 0.2}


async def test_gymnasium_image_on_every_turn() -> None:
    script = ["<action>inc</action>", "<action>inc</action>", "<action>stop</action>"]
    result = await _run(StepCounterEnv(), script, {**step_counter_rows(1)[0], "target": 2}, gymnasium=True)
    traj = trajectory.from_gym_result(result, placeholder_token_ids={"image": IMAGE_TOKEN_ID})
    assert len(traj.turns) == 3
    assert [len(t.media) for t in traj.turns] == [1, 1, 1]
    assert [t.media[0].raw for t in traj.turns] == [png_of(0), png_of(1), png_of(2)]
    assert traj.reward == 1.0
