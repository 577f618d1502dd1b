"""Regression tests for defects found in review of the native rollout loop (one test per bug)."""

from __future__ import annotations

from typing import Any

import pytest

from gymbridge.errors import ProtocolError
from gymbridge.generation.hf import HFGenerator
from gymbridge.rollout import run_episode, run_group

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(("key", "value"), [("temperature", "hot"), ("temperature", -1.0), ("top_p", 0)])
async def test_regression_bad_row_sampling_is_recorded_not_raised_through_the_group(
    tiny_gen: HFGenerator, zoom_env: str, zoom_row: dict[str, Any], key: str, value: Any
) -> None:
    row = {**zoom_row, "responses_create_params": {**zoom_row["responses_create_params"], key: value}}
    with pytest.raises(ProtocolError, match=key):
        await run_episode(tiny_gen, zoom_env, row, max_turns=1)
    results = await run_group(tiny_gen, zoom_env, row, num_rollouts=2, max_turns=1)
    assert [r["_ng_rollout_index"] for r in results] == [0, 1]
    assert all(r["mask_sample"] and r["failure_kind"] == "ProtocolError" for r in results)
    assert all(key in r["failure_reason"] for r in results)


async def test_regression_group_over_a_batching_generator_shares_batches(tiny_gen: HFGenerator) -> None:
    """A BatchingGenerator had no ``codec``, so run_group over one raised; and the issue's
    "rollouts for a group run concurrently" means their model calls share forward passes."""
    from gymbridge.generation.batching import BatchingGenerator
    from gymbridge.generation.types import SamplingConfig
    from gymbridge.server import start_server
    from gymbridge_envs.registry import get_env

    row = get_env("counter").make_row(0, 0)
    batched = BatchingGenerator(tiny_gen, window_s=0.05)
    try:
        async with await start_server(get_env("counter").make_server()) as env:
            results = await run_group(
                batched,
                env.url,
                row,
                num_rollouts=4,
                max_turns=1,
                sampling=SamplingConfig(max_tokens=3),  # unseeded: seeded calls never share a batch
            )
    finally:
        await batched.aclose()
    assert not any(r.get("mask_sample") for r in results)
    assert batched.rows_run == 4 and batched.batches_run < 4, "the group's rollouts ran one after another"


async def test_regression_native_loop_row_temperature_below_float32_range_is_greedy(
    tiny_gen: HFGenerator, zoom_env: str, zoom_row: dict[str, Any]
) -> None:
    """A row's ``temperature: 1e-40`` reached the generator as is: the rollout failed with a bare
    ``RuntimeError`` (inf/NaN probabilities). It is greedy decoding, as the model server treats it."""
    import math

    def with_temperature(t: float) -> dict[str, Any]:
        return {
            **zoom_row,
            "responses_create_params": {**zoom_row["responses_create_params"], "temperature": t},
        }

    greedy = await run_episode(tiny_gen, zoom_env, with_temperature(0.0), max_turns=1, default_max_tokens=4)
    tiny = await run_episode(tiny_gen, zoom_env, with_temperature(1e-40), max_turns=1, default_max_tokens=4)

    def last(result: dict[str, Any]) -> dict[str, Any]:
        item: dict[str, Any] = result["response"]["output"][-1]
        return item

    assert last(tiny)["generation_token_ids"] == last(greedy)["generation_token_ids"]
    assert last(tiny)["generation_log_probs"] == last(greedy)["generation_log_probs"]
    assert all(math.isfinite(lp) for lp in last(tiny)["generation_log_probs"])
