"""grid_door: game rules, solvable layouts, and the gymnasium server over loopback HTTP (check_env)."""

from __future__ import annotations

import base64
import io
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from gymbridge.protocol import parse_reset_response, parse_step_response
from gymbridge.server import check_env
from gymbridge_envs._testing import message, response, running, user
from gymbridge_envs.grid_door.data import generate, make_row
from gymbridge_envs.grid_door.game import CELL_PX, GameOver, GridState, optimal_actions, parse_action
from gymbridge_envs.grid_door.server import GridDoorServer

#   0 1 2
# 0 A . K
# 1 # # .
# 2 D . .
LAYOUT: dict[str, Any] = {
    "size": 3,
    "walls": [[1, 0], [1, 1]],
    "key": [0, 2],
    "door": [2, 0],
    "agent": [0, 0],
}


def _act(action: str) -> dict[str, Any]:
    return response(message(f"I will go {action}. <action>{action}</action>"))


def test_parse_action_takes_the_last_known_action() -> None:
    assert parse_action("<action>up</action>") == "up"
    assert parse_action("<action> LEFT </action> then <action>down</action>") == "down"
    assert parse_action("<action>jump</action>") is None
    assert parse_action("up") is None


def test_rules_key_door_walls_and_truncation() -> None:
    state = GridState.from_layout(LAYOUT, max_steps=12)
    assert state.step("down") == 0.0 and "wall" in state.last_event and state.agent == (0, 0)
    assert state.step("up") == 0.0 and "wall" in state.last_event  # the border is a wall too
    assert state.step(None) == 0.0 and "Invalid" in state.last_event and state.steps == 3
    state.step("right")
    state.step("right")
    assert state.has_key and "key" in state.last_event and "K" not in state.ascii()
    for action in ("down", "down", "left"):
        assert state.step(action) == 0.0
    assert state.step("left") == 1.0 and state.terminated and not state.truncated
    with pytest.raises(GameOver):
        state.step("up")

    locked = GridState.from_layout({**LAYOUT, "agent": [2, 1]}, max_steps=2)
    assert locked.step("left") == 0.0 and "locked" in locked.last_event and locked.agent == (2, 1)
    assert locked.step("left") == 0.0 and locked.truncated and not locked.terminated


def test_render_draws_each_cell() -> None:
    state = GridState.from_layout(LAYOUT, max_steps=5)
    image = state.render()
    assert image.size == (3 * CELL_PX, 3 * CELL_PX)
    assert image.getpixel((CELL_PX // 2, CELL_PX + CELL_PX // 2)) == (70, 70, 78)  # wall at (1, 0)
    assert image.getpixel((CELL_PX // 2, CELL_PX // 2)) == (40, 110, 220)  # agent at (0, 0)
    assert "A.K" in state.observation_text() and "Step 0/5" in state.observation_text()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), index=st.integers(0, 50), size=st.integers(3, 7))
def test_generated_layouts_are_solvable_within_the_step_limit(seed: int, index: int, size: int) -> None:
    row = make_row(seed, index, size=size)
    actions = optimal_actions(row["grid"])
    assert len(actions) == row["optimal_steps"] <= row["max_steps"]
    state = GridState.from_layout(row["grid"], row["max_steps"])
    rewards = [state.step(a) for a in actions]
    assert rewards[-1] == 1.0 and sum(rewards) == 1.0 and state.terminated


async def test_check_env_passes_in_gymnasium_mode() -> None:
    rows = list(generate(2, seed=0))
    async with running(GridDoorServer()) as url:
        report = await check_env(
            url, rows, answer_text="<action>up</action>", generate=lambda seed: list(generate(2, seed))
        )
    assert report.ok


def _image(part: dict[str, Any]) -> Image.Image:
    assert part["type"] == "input_image" and part["detail"] == "auto"
    return Image.open(io.BytesIO(base64.b64decode(part["image_url"].split(",", 1)[1])))


async def test_full_episode_has_an_image_every_step_and_reward_one() -> None:
    row = make_row(1, 2)
    actions = optimal_actions(row["grid"])
    async with running(GridDoorServer()) as url, httpx.AsyncClient(base_url=url) as client:
        early = await client.post("/step", json={**row, "response": _act("up")})
        assert early.status_code == 409 and "reset" in early.text

        reset = (await client.post("/reset", json=row)).json()
        parse_reset_response(reset)  # stock shape
        assert reset["info"]["max_steps"] == row["max_steps"]
        images = [_image(reset["observation_content"][0])]
        assert reset["observation_content"][1] == {"type": "input_text", "text": reset["observation"]}
        total, output = 0.0, [user(reset["observation"])]
        for action in actions:
            step = (await client.post("/step", json={**row, "response": _act(action)})).json()
            parse_step_response(step)
            images.append(_image(step["observation_content"][0]))
            total += step["reward"]
            assert step["info"]["action"] == action
            output += [_act(action)["output"][0], user(step["observation"])]
        assert step["terminated"] and not step["truncated"] and total == 1.0
        assert len({img.tobytes() for img in images}) == len(actions) + 1  # the picture changes every step

        after = await client.post("/step", json={**row, "response": _act("up")})
        assert after.status_code == 409  # the finished episode was released

        verdict = (await client.post("/verify", json={**row, "response": response(*output)})).json()
        assert verdict["reward"] == 1.0 and verdict["actions"] == actions


async def test_invalid_actions_cost_steps_until_truncation() -> None:
    row = {**make_row(0, 0), "max_steps": 2}
    async with running(GridDoorServer()) as url, httpx.AsyncClient(base_url=url) as client:
        await client.post("/reset", json=row)
        first = (await client.post("/step", json={**row, "response": response(message("hmm"))})).json()
        assert first["info"]["valid_action"] is False and "Invalid" in first["observation"]
        second = (await client.post("/step", json={**row, "response": response(message("?"))})).json()
        assert second["truncated"] and not second["terminated"] and second["reward"] == 0.0
        bad = await client.post("/reset", json={**row, "grid": {"size": 3}})
        assert bad.status_code == 422
