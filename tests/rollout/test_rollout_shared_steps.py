"""The native loop turns ``/step`` answers into the same items as ``SimpleAgent`` (one shared code path)."""

from __future__ import annotations

import pytest

from gymbridge.errors import EnvServerError
from gymbridge.generation.hf import HFGenerator
from gymbridge.generation.types import SamplingConfig
from gymbridge.server import start_server
from tests.server.raw_gym_env import BAD_STEPS, EXPECTED_ENV_ITEMS, ROW, env_items, raw_gym_app


async def test_native_loop_step_items_match_the_agent(tiny_gen: HFGenerator) -> None:
    async with await start_server(raw_gym_app()) as env:
        result = await run(tiny_gen, env.url, ROW)
    assert result["reward"] == 1.0 and result["terminated"] is True
    assert env_items(result["response"]["output"]) == EXPECTED_ENV_ITEMS  # what the agent test asserts


@pytest.mark.parametrize("bad", ["tool_output_not_an_object", "terminated_is_string"])
async def test_regression_native_loop_refuses_malformed_step(tiny_gen: HFGenerator, bad: str) -> None:
    """Formerly skipped (a non-object tool output) or read as truthy (a string flag)."""
    async with await start_server(raw_gym_app()) as env:
        with pytest.raises(EnvServerError, match="/step answered an invalid body"):
            await run(tiny_gen, env.url, {**ROW, "bad": bad})
    assert bad in BAD_STEPS


async def run(gen: HFGenerator, url: str, row: dict[str, object]) -> dict[str, object]:
    from gymbridge.rollout import run_episode

    sampling = SamplingConfig(max_tokens=4, seed=0)
    return await run_episode(gen, url, row, max_turns=4, mode="gymnasium", sampling=sampling)
