"""circle_click: scenes, renderer, reward, and the server over loopback HTTP (check_env)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gymbridge.server import check_env
from gymbridge_envs._testing import call, message, response, running
from gymbridge_envs.circle_click.data import COLORS, click_reward, generate, make_row, parse_click, render
from gymbridge_envs.circle_click.server import CircleClickServer


def _target(row: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in row["circles"] if c["color"] == row["target_color"])


@pytest.mark.parametrize("index", range(8))
def test_scene_invariants(index: int) -> None:
    row = make_row(3, index, img_size=200, radius_min=15, radius_max=25)
    circles = row["circles"]
    assert len({c["color"] for c in circles}) == len(circles) >= 3
    assert row["target_color"] in {c["color"] for c in circles}
    for i, a in enumerate(circles):
        assert a["radius"] <= a["x"] <= 200 - a["radius"] and a["radius"] <= a["y"] <= 200 - a["radius"]
        for b in circles[i + 1 :]:
            assert math.hypot(a["x"] - b["x"], a["y"] - b["y"]) > a["radius"] + b["radius"]


def test_rendered_target_centre_has_target_colour() -> None:
    row = make_row(0, 0)
    image = render(row["circles"], 320)
    t = _target(row)
    assert image.size == (320, 320)
    assert image.getpixel((t["x"], t["y"])) == COLORS[row["target_color"]]
    assert image.getpixel((0, 0)) == (255, 255, 255)


@settings(max_examples=60, deadline=None)
@given(index=st.integers(0, 50), dx=st.integers(-60, 60), dy=st.integers(-60, 60))
def test_reward_is_one_exactly_inside_the_target_circle(index: int, dx: int, dy: int) -> None:
    row = make_row(1, index)
    t = _target(row)
    x, y = t["x"] + dx, t["y"] + dy
    inside = dx * dx + dy * dy <= t["radius"] ** 2
    assert click_reward(row["circles"], row["target_color"], x, y) == (1.0 if inside else 0.0)


def test_parse_click_reads_like_stock_gym() -> None:
    assert parse_click({"x": 10, "y": "12"}) == (10, 12)
    assert parse_click({"x": 10.9, "y": 3}) == (10, 3)  # int() truncates, as stock does
    assert parse_click({"x": [1, 2], "y": 3}) == (None, None)
    assert parse_click({"x": True, "y": 3}) == (None, None)
    assert parse_click({"x": 1}) == (None, None)
    assert parse_click(None) == (None, None)
    assert click_reward([], "red", 1, 1) == 0.0
    assert click_reward([{"x": 0, "y": 0, "radius": 5, "color": "red"}], "red", None, None) == 0.0


async def test_check_env_passes_and_a_centre_click_scores_one() -> None:
    row = make_row(5, 0)
    t = _target(row)
    async with running(CircleClickServer()) as url:
        report = await check_env(
            url,
            [row],
            tool_args={"click": {"x": t["x"], "y": t["y"]}},
            generate=lambda seed: list(generate(2, seed)),
        )
    assert report.ok and report.rewards == [1.0]


async def test_verify_scores_the_first_click_and_refuses_rows_without_task_data() -> None:
    row = make_row(6, 1)
    t = _target(row)
    far = {"x": t["x"] + 3 * t["radius"] + 400, "y": t["y"]}
    hit = {"x": t["x"], "y": t["y"]}
    async with running(CircleClickServer()) as url, httpx.AsyncClient(base_url=url) as client:
        first_miss = response(call("click", far), call("click", hit))
        r = await client.post("/verify", json={**row, "response": first_miss})
        assert r.status_code == 200 and r.json()["reward"] == 0.0 and r.json()["hit"] is False

        first_hit = response(call("click", hit), message("done"))
        body = (await client.post("/verify", json={**row, "response": first_hit})).json()
        assert body["reward"] == 1.0 and body["hit"] is True
        assert (body["clicked_x"], body["clicked_y"]) == (t["x"], t["y"])
        assert body["circles"] == row["circles"]  # the row is echoed

        no_click = (await client.post("/verify", json={**row, "response": response(message("hi"))})).json()
        assert no_click["reward"] == 0.0 and no_click["clicked_x"] is None

        stripped = {"responses_create_params": row["responses_create_params"], "response": first_hit}
        bad = await client.post("/verify", json=stripped)
        assert bad.status_code == 422
        assert {tuple(d["loc"]) for d in bad.json()["detail"]} >= {
            ("body", "circles"),
            ("body", "target_color"),
        }

        echo = await client.post("/click", json={"x": 3, "y": 4})
        assert echo.status_code == 200 and echo.json() == {"x": 3, "y": 4}
        wrong = await client.post("/click", json={"x": [1, 2], "y": 4})
        assert wrong.status_code == 422  # the error body goes back to the model


async def test_verify_matches_stock_gym_on_its_recorded_rollouts() -> None:
    """Golden: stock circle_click's own recorded verdicts (incl. list-valued x/y) are reproduced."""
    golden = json.loads((Path(__file__).parent / "stock_verify_golden.json").read_text())
    async with running(CircleClickServer()) as url, httpx.AsyncClient(base_url=url) as client:
        for case in golden["cases"]:
            row = {"responses_create_params": {"input": []}, "circles": case["circles"]}
            row["target_color"] = case["target_color"]
            body = {**row, "response": response(*case["function_calls"], message("ok"))}
            ours = (await client.post("/verify", json=body)).json()
            assert {k: ours[k] for k in case["stock"]} == case["stock"]
