"""bouncing_ball: simulation, rendering, MP4 determinism, and the server over loopback HTTP (check_env)."""

from __future__ import annotations

import base64
import io
import itertools
from pathlib import Path

import av
import httpx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gymbridge.server import check_env
from gymbridge_envs._common import count_reward
from gymbridge_envs._testing import call, message, response, running
from gymbridge_envs.bouncing_ball.data import (
    encode_mp4,
    generate,
    make_row,
    render_frames,
    rgb_to_yuv420p,
    simulate,
)
from gymbridge_envs.bouncing_ball.server import BouncingBallServer


def _decode(raw: bytes) -> np.ndarray:
    with av.open(io.BytesIO(raw), mode="r") as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def _video_bytes(row: dict[str, object]) -> bytes:
    url = row["responses_create_params"]["input"][1]["content"][0]["video_url"]  # type: ignore[index]
    header, payload = url.split(",", 1)
    assert header == "data:video/mp4;base64"
    return base64.b64decode(payload)


@settings(max_examples=50, deadline=None)
@given(
    x=st.floats(5, 58),
    y=st.floats(5, 58),
    vx=st.floats(-12, 12),
    vy=st.floats(-12, 12),
)
def test_simulation_stays_inside_and_counts_reflections(x: float, y: float, vx: float, vy: float) -> None:
    positions, bounces, _corner = simulate((x, y), (vx, vy), num_frames=24, size=64, radius=4)
    assert len(positions) == 24
    assert all(4 <= px <= 59 and 4 <= py <= 59 for px, py in positions)
    # Reference: the number of reflections equals the wall crossings of the unfolded straight line.
    unfolded_x = [x + vx * t for t in range(24)]
    unfolded_y = [y + vy * t for t in range(24)]
    width = 59 - 4

    def crossings(values: list[float]) -> int:
        cells = [int(np.floor((v - 4) / width)) for v in values]
        return sum(abs(b - a) for a, b in itertools.pairwise(cells))

    assert bounces == crossings(unfolded_x) + crossings(unfolded_y)


def test_rows_spread_over_many_answers_and_video_shows_the_ball_every_frame() -> None:
    rows = list(generate(12, seed=0))
    assert len({row["num_bounces"] for row in rows}) >= 5
    frames = _decode(_video_bytes(rows[0]))
    assert frames.shape == (24, 64, 64, 3)
    orange = (frames[..., 0] > 180) & (frames[..., 1] > 90) & (frames[..., 1] < 210) & (frames[..., 2] < 110)
    assert (orange.reshape(24, -1).sum(axis=1) >= 20).all()


def test_encoding_is_byte_identical_across_calls_regression() -> None:
    """Regression: rows differed between two runs in one process (encoder-side colour conversion)."""
    positions, _, _ = simulate((20.0, 30.0), (3.3, 5.1), num_frames=24, size=64, radius=4)
    frames = render_frames(positions, size=64, radius=4)
    first = encode_mp4(frames, 8)
    encode_mp4(render_frames(positions[::-1], size=64, radius=4), 8)  # disturb any encoder state
    assert encode_mp4(frames, 8) == first


def test_colour_conversion_matches_bt601() -> None:
    white = np.full((2, 2, 3), 255, dtype=np.uint8)
    black = np.zeros((2, 2, 3), dtype=np.uint8)
    assert rgb_to_yuv420p(white).tolist() == [[235, 235], [235, 235], [128, 128]]
    assert rgb_to_yuv420p(black).tolist() == [[16, 16], [16, 16], [128, 128]]


def test_video_can_be_written_to_files(tmp_path: Path) -> None:
    row = make_row(0, 3, video_dir=str(tmp_path))
    url = row["responses_create_params"]["input"][1]["content"][0]["video_url"]
    assert url.startswith("file://")
    path = tmp_path / "bouncing_ball-0-3.mp4"
    assert path.as_uri() == url and _decode(path.read_bytes()).shape[0] == 24


async def test_check_env_passes_and_the_right_count_scores_one() -> None:
    row = make_row(4, 0)
    async with running(BouncingBallServer()) as url:
        report = await check_env(
            url,
            [row],
            tool_args={"answer": {"count": row["num_bounces"]}},
            generate=lambda seed: list(generate(2, seed)),
        )
    assert report.ok and report.rewards == [1.0]


async def test_text_answer_and_wrong_answer() -> None:
    row = make_row(4, 1)
    n = row["num_bounces"]
    async with running(BouncingBallServer()) as url, httpx.AsyncClient(base_url=url) as client:
        text = await client.post(
            "/verify", json={**row, "response": response(message(f"It bounced {n} times."))}
        )
        assert text.json()["reward"] == 1.0
        tool = await client.post(
            "/verify", json={**row, "response": response(call("answer", {"count": n + 1}))}
        )
        assert tool.json()["reward"] == 0.0
    assert count_reward(2, 2) == 1.0 and count_reward(2, None) == 0.0
