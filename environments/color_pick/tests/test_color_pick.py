"""color_pick: balanced colours, the reward, the look tool over HTTP, warm-up targets blind to the answer."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gymbridge.server import check_env
from gymbridge_envs._testing import running
from gymbridge_envs.color_pick.data import COLORS, answer_of, format_examples, generate, make_row, pick_reward
from gymbridge_envs.color_pick.server import ColorPickServer


@pytest.mark.parametrize("seed", range(5))
def test_every_block_holds_each_colour_once(seed: int) -> None:
    rows = list(generate(12, seed, colors="red,blue,green"))
    for b in range(4):
        assert sorted(r["color"] for r in rows[3 * b : 3 * b + 3]) == ["blue", "green", "red"]


def test_reward_reads_the_first_word() -> None:
    assert pick_reward("red", "Red.") == 1.0
    assert pick_reward("red", "blue red") == 0.0
    assert pick_reward("red", "") == 0.0 and answer_of("  ") is None


def test_blank_rows_show_grey_and_keep_the_answer() -> None:
    from gymbridge.media import MediaItem

    row = make_row(0, 0, blank=True)
    url = row["responses_create_params"]["input"][0]["content"][0]["image_url"]
    img = MediaItem.from_ref(url, "image").image()
    assert img.getpixel((3, 3)) == (128, 128, 128) and row["color"] in COLORS


@settings(deadline=None)  # no per-example time limit: tests/conftest.py's profile does not reach here
@given(st.integers(0, 10_000), st.sampled_from(["prompt", "tool"]))
def test_warmup_targets_never_depend_on_the_rows_colour(rng_seed: int, reveal: str) -> None:
    """The honesty rule of the format warm-up: same RNG, rows of different colours -> same targets."""
    red = next(r for r in generate(4, 0, reveal=reveal) if r["color"] == "red")
    blue = next(r for r in generate(4, 0, reveal=reveal) if r["color"] == "blue")
    a = [t for _, t in format_examples(red, random.Random(rng_seed))]
    b = [t for _, t in format_examples(blue, random.Random(rng_seed))]
    assert a == b


async def test_check_env_passes_in_both_modes() -> None:
    for reveal in ("prompt", "tool"):
        rows = list(generate(3, 0, reveal=reveal))
        async with running(ColorPickServer()) as url:
            report = await check_env(
                url, rows, generate=lambda seed, r=reveal: list(generate(3, seed, reveal=r))
            )
        assert report.ok, report
