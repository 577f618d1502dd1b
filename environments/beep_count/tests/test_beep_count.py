"""beep_count: synthesis invariants, answer parsing, and the server over loopback HTTP (check_env)."""

from __future__ import annotations

import base64
import io
import itertools

import httpx
import pytest
import soundfile as sf
from hypothesis import given, settings
from hypothesis import strategies as st

from gymbridge.server import check_env
from gymbridge_envs._common import count_reward, parse_int_answer
from gymbridge_envs._testing import call, message, response, running
from gymbridge_envs.beep_count.data import count_beeps, generate, make_row
from gymbridge_envs.beep_count.server import BeepCountServer


def _samples(row: dict[str, object]) -> tuple[object, int]:
    url = row["responses_create_params"]["metadata"]["audio_data"]  # type: ignore[index]
    header, payload = url.split(",", 1)
    assert header == "data:audio/wav;base64"
    data, rate = sf.read(io.BytesIO(base64.b64decode(payload)), dtype="float32")
    return data, rate


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), index=st.integers(0, 100))
def test_clip_holds_exactly_the_announced_beeps(seed: int, index: int) -> None:
    row = make_row(seed, index)
    samples, rate = _samples(row)
    assert rate == 16000 and len(samples) == 48000  # type: ignore[arg-type]
    assert count_beeps(samples, rate) == row["num_beeps"] == len(row["beep_onsets_s"])  # type: ignore[arg-type]
    onsets = row["beep_onsets_s"]
    assert all(b - a >= 0.12 + 0.15 - 1e-3 for a, b in itertools.pairwise(onsets))
    assert onsets[0] >= 0.15 - 1e-3 and onsets[-1] + 0.12 <= 3.0


def test_every_count_in_range_occurs() -> None:
    counts = {row["num_beeps"] for row in generate(40, seed=0)}
    assert counts == set(range(1, 7))


def test_audio_can_travel_as_an_input_audio_part_instead_of_metadata() -> None:
    row = make_row(0, 0, audio_via="part")
    params = row["responses_create_params"]
    assert "metadata" not in params
    part = params["input"][1]["content"][0]
    assert part["type"] == "input_audio" and part["input_audio"]["format"] == "wav"
    assert base64.b64decode(part["input_audio"]["data"])[:4] == b"RIFF"
    with pytest.raises(ValueError, match="audio_via"):
        make_row(0, 0, audio_via="both")  # type: ignore[arg-type]


def test_answer_parsing_precedence() -> None:
    assert parse_int_answer([call("answer", {"count": 4}), message("<answer>3</answer>")]) == 4
    assert parse_int_answer([call("answer", {"count": "4"})]) == 4
    assert parse_int_answer([call("answer", {"count": "four"})]) is None
    assert parse_int_answer([call("answer", "{not json")]) is None
    assert parse_int_answer([message("I think <answer>5</answer>, no, <answer> 6 </answer>")]) == 6
    assert parse_int_answer([message("There are 3 beeps.")]) == 3
    assert parse_int_answer([message("Between 2 and 4, so 3")]) == 3
    assert parse_int_answer([message("at 1.5 s and 2.5 s")]) is None
    assert parse_int_answer([message("no idea")]) is None
    assert parse_int_answer("garbage") is None
    assert count_reward(3, 3) == 1.0 and count_reward(3, 2) == 0.0 and count_reward(3, None) == 0.0


async def test_check_env_passes_and_the_right_count_scores_one() -> None:
    row = make_row(9, 0)
    async with running(BeepCountServer()) as url:
        report = await check_env(
            url,
            [row],
            tool_args={"answer": {"count": row["num_beeps"]}},
            generate=lambda seed: list(generate(2, seed)),
        )
    assert report.ok and report.rewards == [1.0]


async def test_text_answers_are_scored_too() -> None:
    row = make_row(9, 1)
    n = row["num_beeps"]
    async with running(BeepCountServer()) as url, httpx.AsyncClient(base_url=url) as client:
        right = await client.post(
            "/verify", json={**row, "response": response(message(f"<answer>{n}</answer>"))}
        )
        wrong = await client.post("/verify", json={**row, "response": response(message(f"{n + 1} beeps"))})
        assert right.json()["reward"] == 1.0 and right.json()["answered"] == n
        assert wrong.json()["reward"] == 0.0
        assert (await client.post("/answer", json={"count": n})).json() == {"recorded": n, "done": True}
