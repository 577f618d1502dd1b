"""zoom_read: scenes, crops, reward, and the multi-turn server over loopback HTTP (check_env)."""

from __future__ import annotations

import asyncio
import base64
import io
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from gymbridge.server import check_env
from gymbridge_envs._testing import call, message, response, running
from gymbridge_envs.zoom_read.data import (
    TARGET_COLOR,
    answer_reward,
    clamp_bbox,
    crop,
    generate,
    make_row,
    normalize_answer,
    render,
    target_bbox,
)
from gymbridge_envs.zoom_read.server import ZoomReadServer

SMALL = {"canvas_size": 512, "num_distractors": 4}


def _decode_part(part: dict[str, Any]) -> Image.Image:
    assert part["type"] == "input_image" and part["detail"] == "auto"
    header, payload = part["image_url"].split(",", 1)
    assert header == "data:image/png;base64"
    return Image.open(io.BytesIO(base64.b64decode(payload))).convert("RGB")


def _red_pixels(image: Image.Image) -> int:
    arr = np.asarray(image).astype(int)
    return int(np.sum(np.abs(arr - np.array(TARGET_COLOR)).sum(axis=-1) < 60))


@pytest.mark.parametrize("index", range(6))
def test_scene_has_one_boxed_target_inside_the_canvas(index: int) -> None:
    row = make_row(0, index, **SMALL)
    scene = row["scene"]
    boxed = [item for item in scene["items"] if item["box"]]
    assert len(boxed) == 1 and boxed[0]["text"] == row["target_value"] and len(row["target_value"]) == 4
    x0, y0, x1, y1 = target_bbox(scene)
    assert 0 <= x0 < x1 <= 512 and 0 <= y0 < y1 <= 512
    canvas = render(scene)
    assert canvas.size == (512, 512)
    assert _red_pixels(canvas.crop((x0, y0, x1 + 1, y1 + 1))) > 20  # the red box and digits are drawn there


def test_preview_is_small_and_render_is_pure() -> None:
    row = make_row(1, 0, **SMALL)
    preview = _decode_part(row["responses_create_params"]["input"][1]["content"][0])
    assert preview.size == (256, 256)
    assert render(row["scene"]).tobytes() == render(row["scene"]).tobytes()


def test_crop_clamps_and_scales_to_zoom_size() -> None:
    canvas = Image.new("RGB", (100, 100))
    assert clamp_bbox([-10, -5, 50, 200], 100) == (0, 0, 50, 100)
    assert crop(canvas, [0, 0, 50, 25], 256).size == (256, 128)
    for bad in ([5, 5, 5, 10], [10, 0, 0, 10], [200, 200, 300, 300], [1, 2, 3]):
        with pytest.raises(ValueError, match="bbox"):
            clamp_bbox(bad, 100)


def test_answer_normalisation_and_reward() -> None:
    assert normalize_answer(" 4,821 ") == "4821"
    assert normalize_answer(4821) == "4821" == normalize_answer(4821.0)
    assert normalize_answer("none") is None and normalize_answer(True) is None
    assert answer_reward("4821", "4821") == 1.0
    assert answer_reward("4821", "482") == 0.0
    assert answer_reward("4821", None) == 0.0


async def test_check_env_passes_with_a_target_zoom_and_the_right_answer() -> None:
    row = make_row(2, 0, **SMALL)
    x0, y0, x1, y1 = target_bbox(row["scene"])
    async with running(ZoomReadServer()) as url:
        report = await check_env(
            url,
            [row],
            tool_args={
                "zoom": {"bbox": [x0 - 20, y0 - 20, x1 + 20, y1 + 20]},
                "answer": {"value": row["target_value"]},
            },
            generate=lambda seed: list(generate(1, seed, **SMALL)),
        )
    assert report.ok and report.rewards == [1.0]


async def test_multi_turn_zoom_then_answer() -> None:
    row = make_row(3, 1, **SMALL)
    x0, y0, x1, y1 = target_bbox(row["scene"])
    async with running(ZoomReadServer(max_zooms=3)) as url, httpx.AsyncClient(base_url=url) as client:
        early = await client.post("/zoom", json={"bbox": [0, 0, 10, 10]})
        assert early.status_code == 409 and "seed_session" in early.text

        assert (await client.post("/seed_session", json=row)).status_code == 200
        r = await client.post("/zoom", json={"bbox": [x0 - 8, y0 - 8, x1 + 8, y1 + 8]})
        assert r.status_code == 200 and r.headers["X-Gymbridge-Tool-Output"] == "parts"
        parts = r.json()
        assert parts[0]["type"] == "input_text" and "canvas" in parts[0]["text"]
        crop_image = _decode_part(parts[1])
        assert max(crop_image.size) == 256
        assert _red_pixels(crop_image) > 200  # the box fills the crop, magnified

        empty = await client.post("/zoom", json={"bbox": [10, 10, 10, 20]})
        assert empty.status_code == 422 and "empty" in empty.text
        corner = _decode_part((await client.post("/zoom", json={"bbox": [-50, -50, 4, 4]})).json()[1])
        assert corner.size == (256, 256)
        assert (await client.post("/zoom", json={"bbox": [0, 0, 100, 50]})).status_code == 200
        over = await client.post("/zoom", json={"bbox": [0, 0, 10, 10]})
        assert over.status_code == 429 and "limit" in over.text

        assert (await client.post("/answer", json={"value": row["target_value"]})).json()["done"] is True
        again = await client.post("/answer", json={"value": "0"})
        assert again.status_code == 409

        out = response(
            call("zoom", {"bbox": [x0, y0, x1, y1]}), call("answer", {"value": row["target_value"]})
        )
        body = (await client.post("/verify", json={**row, "response": out})).json()
        assert body["reward"] == 1.0 and body["num_zooms"] == 3 and body["answered"] == row["target_value"]

        wrong_first = response(call("answer", {"value": "1"}), call("answer", {"value": row["target_value"]}))
        assert (await client.post("/verify", json={**row, "response": wrong_first})).json()["reward"] == 0.0


async def test_verify_falls_back_to_the_sessions_recorded_answer() -> None:
    row = make_row(3, 2, **SMALL)
    async with running(ZoomReadServer()) as url, httpx.AsyncClient(base_url=url) as client:
        await client.post("/seed_session", json=row)
        recorded = await client.post("/answer", json={"value": int(row["target_value"])})  # a number is fine
        assert recorded.json() == {"recorded": row["target_value"], "done": True}
        body = (await client.post("/verify", json={**row, "response": response(message("done"))})).json()
        assert body["reward"] == 1.0


async def test_concurrent_sessions_of_one_prompt_render_the_canvas_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gymbridge_envs.zoom_read.server as server_module

    calls: list[int] = []

    def counting_render(scene: dict[str, Any]) -> Image.Image:
        calls.append(1)
        return render(scene)

    monkeypatch.setattr(server_module, "render", counting_render)
    row = make_row(4, 0, **SMALL)

    async def one_session(url: str) -> int:
        async with httpx.AsyncClient(base_url=url) as client:
            await client.post("/seed_session", json=row)
            return (await client.post("/zoom", json={"bbox": [0, 0, 64, 64]})).status_code

    async with running(ZoomReadServer()) as url:
        statuses = await asyncio.gather(*(one_session(url) for _ in range(8)))
    assert statuses == [200] * 8 and len(calls) == 1


def test_format_examples_teach_the_zoom_call_never_the_answer() -> None:
    """The warm-up target is a whole-canvas zoom: the same for every row of a canvas size, a valid call."""
    import json
    import random

    from gymbridge_envs.zoom_read.data import format_examples, zoom_call_text

    rows = list(generate(6, 3, **SMALL))
    assert len({r["target_value"] for r in rows}) > 1
    targets = {t for r in rows for _, t in format_examples(r, random.Random(0))}
    assert targets == {zoom_call_text([0, 0, 512, 512])}
    body = zoom_call_text([0, 0, 512, 512]).removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")
    assert json.loads(body) == {"name": "zoom", "arguments": {"bbox": [0, 0, 512, 512]}}
    assert format_examples(rows[0], random.Random(1))[0][0] == rows[0]["responses_create_params"]["input"]
