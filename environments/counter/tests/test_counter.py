"""counter: generator invariants and session state over loopback HTTP (check_env, isolation, stock rows)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from gymbridge.server import check_env
from gymbridge_envs._common import count_reward
from gymbridge_envs._testing import message, response, running
from gymbridge_envs.counter.data import generate, make_row
from gymbridge_envs.counter.server import CounterServer

STOCK_ROW = json.loads((Path(__file__).parent / "stock_example_row.json").read_text())
"""Row 0 of stock Gym's example_session_state_mgmt/data/example.jsonl (golden protocol shape)."""


@pytest.mark.parametrize("index", range(10))
def test_expected_count_is_initial_plus_increments(index: int) -> None:
    row = make_row(2, index)
    assert row["expected_count"] == row["initial_count"] + sum(row["increments"])
    text = row["responses_create_params"]["input"][1]["content"]
    assert all(f"add {k}" in text for k in row["increments"]) and text.endswith("get the count")


def test_reward() -> None:
    assert count_reward(5, 5) == 1.0
    assert count_reward(5, 4) == 0.0
    assert count_reward(5, None) == 0.0


async def test_check_env_passes() -> None:
    rows = list(generate(3, seed=0))
    async with running(CounterServer()) as url:
        report = await check_env(url, rows, generate=lambda seed: list(generate(3, seed)))
    assert report.ok and len(report.rewards) == 3


async def _play(url: str, row: dict[str, object], increments: list[int]) -> dict[str, object]:
    async with httpx.AsyncClient(base_url=url) as client:  # one client = one cookie jar = one session
        assert (await client.post("/seed_session", json=row)).json() == {}
        for k in increments:
            assert (await client.post("/increment_counter", json={"count": k})).json() == {"success": True}
            await asyncio.sleep(0)  # interleave with the other sessions
        got = (await client.post("/get_counter_value", json={})).json()
        verdict = (await client.post("/verify", json={**row, "response": response(message(str(got)))})).json()
        return {"got": got, **verdict}


async def test_sessions_are_isolated_and_correct_play_scores_one() -> None:
    rows = list(generate(6, seed=4))
    async with running(CounterServer()) as url:
        good = [_play(url, row, row["increments"]) for row in rows]
        wrong = [_play(url, row, [*row["increments"], 1]) for row in rows]
        results = await asyncio.gather(*good, *wrong)
    for row, result in zip(rows * 2, results, strict=True):
        assert result["expected_count"] == row["expected_count"]
    assert [r["reward"] for r in results] == [1.0] * 6 + [0.0] * 6
    assert [r["got"] for r in results[:6]] == [{"count": row["expected_count"]} for row in rows]


async def test_stock_example_row_plays_the_same_as_stock_gym() -> None:
    async with running(CounterServer()) as url:
        result = await _play(url, STOCK_ROW, [1, 2])  # "add 1 then add 2 then get the count", starts at 3
    assert result["got"] == {"count": 6} and result["reward"] == 1.0


async def test_verify_without_seed_scores_zero_and_says_why() -> None:
    row = make_row(0, 0)
    async with running(CounterServer()) as url, httpx.AsyncClient(base_url=url) as client:
        body = (await client.post("/verify", json={**row, "response": response(message("1"))})).json()
        assert body["reward"] == 0.0 and body["failure_kind"] == "counter:session_not_seeded"
        missing = await client.post("/verify", json={"responses_create_params": {}, "response": response()})
        assert missing.status_code == 422
        bad = await client.post("/increment_counter", json={"count": "many"})
        assert bad.status_code == 422
