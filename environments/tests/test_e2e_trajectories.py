"""End to end: SimpleAgent + scripted model + each environment -> /run result -> Trajectory.

Each environment is solved by its oracle script (reward 1.0) and the result is parsed by
``gymbridge.trajectory.from_gym_result``; the per-turn media index must put every image,
clip and crop on the turn that first sees it: circle_click's image on turn 0, each
zoom_read crop on the turn after its tool call, one new grid_door image on every turn,
beep_count's audio and bouncing_ball's video on turn 0, nothing for counter.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gymbridge.server import SimpleAgent
from gymbridge.testing.scripted_model import ScriptedModelServer
from gymbridge.trajectory import Trajectory, from_gym_result
from gymbridge_envs import get_env
from gymbridge_envs._testing import oracle_script, running

pytestmark = pytest.mark.integration


async def _rollout(env: str, row: dict[str, Any], script: list[Any]) -> tuple[dict[str, Any], Trajectory]:
    spec = get_env(env)
    async with ScriptedModelServer(script) as model, running(spec.make_server()) as env_url:
        agent = SimpleAgent(
            resources_url=env_url, model_url=model.url, gymnasium=spec.style == "gymnasium", max_steps=32
        )
        async with running(agent) as agent_url, httpx.AsyncClient(timeout=30) as client:
            reply = await client.post(f"{agent_url}/run", json=row)
    assert reply.status_code == 200, reply.text[:500]
    result: dict[str, Any] = reply.json()
    return result, from_gym_result(result)


def _modalities(traj: Trajectory) -> list[list[str]]:
    return [[m.modality for m in turn.media] for turn in traj.turns]


@pytest.mark.parametrize(
    ("env", "first_turn"),
    [
        ("circle_click", ["image"]),
        ("color_pick", ["image"]),
        ("side_pick", ["image"]),
        ("beep_count", ["audio"]),
        ("bouncing_ball", ["video"]),
        ("counter", []),
    ],
)
async def test_single_media_environments_put_their_media_on_turn_0(env: str, first_turn: list[str]) -> None:
    row = get_env(env).make_row(21, 0)
    result, traj = await _rollout(env, row, oracle_script(env, row))
    assert result["reward"] == 1.0
    media = _modalities(traj)
    assert media[0] == first_turn and all(not later for later in media[1:])
    assert len(traj.turns) == len(oracle_script(env, row))


async def test_zoom_read_crops_land_on_the_turn_after_each_zoom() -> None:
    row = get_env("zoom_read").make_row(21, 0, canvas_size=512, num_distractors=4)
    script = oracle_script("zoom_read", row, zooms=2)  # zoom, zoom, answer, final text
    result, traj = await _rollout("zoom_read", row, script)
    assert result["reward"] == 1.0
    assert [t.tool_name for t in traj.turns[:3]] == ["zoom", "zoom", "answer"]
    assert _modalities(traj) == [["image"], ["image"], ["image"], []]
    keys = [turn.media[0].key for turn in traj.turns[:3]]
    assert len(set(keys)) == 3  # preview, first crop, second crop: three different pictures


async def test_grid_door_gets_one_new_image_every_turn() -> None:
    row = get_env("grid_door").make_row(21, 3)
    script = oracle_script("grid_door", row)
    result, traj = await _rollout("grid_door", row, script)
    assert result["reward"] == 1.0
    assert len(traj.turns) == len(script) == row["optimal_steps"]
    assert _modalities(traj) == [["image"]] * len(script)
    assert len({turn.media[0].key for turn in traj.turns}) == len(script)  # the agent moved every turn
