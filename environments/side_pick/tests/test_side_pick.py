"""side_pick: balanced sides, the bar where the letter says, the reward, warm-up targets blind to the side."""

from __future__ import annotations

import random

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gymbridge.media import MediaItem
from gymbridge.models.tiny_vlm import build_tiny_tokenizer
from gymbridge.server import check_env
from gymbridge_envs._testing import message, response, running
from gymbridge_envs.side_pick.data import (
    SIDES,
    answer_of,
    format_examples,
    generate,
    make_row,
    render,
    side_reward,
)
from gymbridge_envs.side_pick.server import SidePickServer


def _image(row: dict[str, object]) -> object:
    url = row["responses_create_params"]["input"][0]["content"][0]["image_url"]  # type: ignore[index]
    return MediaItem.from_ref(url, "image").image()


@pytest.mark.parametrize("seed", range(5))
def test_every_block_holds_each_side_once(seed: int) -> None:
    rows = list(generate(12, seed))
    for b in range(3):
        assert sorted(r["side"] for r in rows[4 * b : 4 * b + 4]) == sorted(SIDES)


@pytest.mark.parametrize("index", range(8))
def test_the_bar_lies_along_the_rows_side_and_nowhere_else(index: int) -> None:
    row = make_row(3, index)
    img = _image(row)
    n, t = int(row["img_size"]), int(row["thickness"])
    dark = {(x, y) for x in range(n) for y in range(n) if img.getpixel((x, y))[0] < 128}  # type: ignore[attr-defined]
    edge = {
        "T": lambda x, y: y < t,
        "B": lambda x, y: y >= n - t,
        "L": lambda x, y: x < t,
        "R": lambda x, y: x >= n - t,
    }
    want = {(x, y) for x in range(n) for y in range(n) if edge[row["side"]](x, y)}
    assert dark == want and 14 <= t <= 20


def test_every_side_has_the_same_dark_area_at_a_given_thickness() -> None:
    """Only where the bar is tells the side: no colour or amount of dark differs between sides."""
    areas = {sum(n for n, rgb in render(s, 9, 56).getcolors() if rgb[0] < 128) for s in SIDES}
    assert areas == {9 * 56}


def test_blank_rows_show_no_bar_and_keep_the_answer() -> None:
    row = make_row(0, 0, blank=True)
    img = _image(row)
    assert img.getcolors() == [(168 * 168, (255, 255, 255))] and row["side"] in SIDES  # type: ignore[attr-defined]


def test_answer_letters_are_one_token_each() -> None:
    tok = build_tiny_tokenizer()
    for letter in SIDES:
        assert len(tok.encode(letter)) == 1, letter


def test_reward_reads_the_first_word() -> None:
    assert side_reward("T", "t.") == 1.0 and side_reward("L", "L") == 1.0
    assert side_reward("T", "B T") == 0.0 and side_reward("T", "Top") == 0.0
    assert side_reward("T", "") == 0.0 and answer_of("  ") is None


@settings(deadline=None)  # no per-example time limit: tests/conftest.py's profile does not reach here
@given(st.integers(0, 10_000))
def test_warmup_targets_never_depend_on_the_rows_side(rng_seed: int) -> None:
    """The honesty rule of the format warm-up: same RNG, rows of different sides -> same targets."""
    rows = list(generate(4, 0))
    targets = {tuple(t for _, t in format_examples(r, random.Random(rng_seed))) for r in rows}
    assert len(targets) == 1


async def test_check_env_passes_and_verify_scores_the_letter_over_http() -> None:
    rows = list(generate(3, 0))
    async with running(SidePickServer()) as url:
        report = await check_env(url, rows, generate=lambda seed: list(generate(3, seed)))
        assert report.ok, report
        row = rows[0]
        wrong = next(s for s in SIDES if s != row["side"])
        async with httpx.AsyncClient(base_url=url) as client:
            right = await client.post("/verify", json={**row, "response": response(message(row["side"]))})
            assert right.status_code == 200 and right.json()["reward"] == 1.0
            miss = await client.post("/verify", json={**row, "response": response(message(wrong))})
            assert miss.json()["reward"] == 0.0
            stripped = {"responses_create_params": row["responses_create_params"], "response": response()}
            bad = await client.post("/verify", json=stripped)
    assert bad.status_code == 422
    assert ("body", "side") in {tuple(d["loc"]) for d in bad.json()["detail"]}
