"""Policy versions through a multi-turn episode: a weight update between turns is recorded.

The generator's ``policy_version`` is bumped after the episode's first model call (what a
weight publisher does after an optimizer step while an episode is in flight); both the
native loop and the model-server path must stamp each call's last output item with the
version that produced it, and the trajectory must carry both versions.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from rollout_helpers import run_via_model_server, zoom_call_tokens

from gymbridge.generation.hf import HFGenerator
from gymbridge.generation.scripted import ScriptedGenerator
from gymbridge.generation.types import Generation, SamplingConfig, wrapped_policy_version
from gymbridge.rollout import NativeModel, run_episode
from gymbridge.trajectory import from_gym_result
from gymbridge.trajectory.types import GenerationInput

pytestmark = pytest.mark.integration

SAMPLING = SamplingConfig(temperature=0.8, max_tokens=12, seed=7)


class BumpAfterFirstCall:
    """Wraps a generator; after its first call the wrapped generator's version becomes 1."""

    def __init__(self, inner: ScriptedGenerator) -> None:
        self.inner = inner
        self.codec = inner.codec
        self.max_model_len = inner.max_model_len
        self.calls = 0

    policy_version = wrapped_policy_version("inner")

    async def generate(self, inputs: Sequence[GenerationInput], sampling: SamplingConfig) -> list[Generation]:
        out = await self.inner.generate(inputs, sampling)
        self.calls += 1
        if self.calls == 1:
            self.inner.policy_version = 1
        return out


@pytest.fixture
def straddling(tiny_gen: HFGenerator) -> Iterator[BumpAfterFirstCall]:
    script = [zoom_call_tokens(tiny_gen, [0, 0, 128, 128]), None]
    gen = BumpAfterFirstCall(ScriptedGenerator(tiny_gen, script))
    try:
        yield gen
    finally:
        tiny_gen.policy_version = 0  # the session generator is shared


def item_versions(result: dict[str, Any]) -> list[int | None]:
    """``policy_version`` of every output item that carries token fields, in order."""
    return [
        item.get("policy_version")
        for item in result["response"]["output"]
        if item.get("generation_token_ids") is not None
    ]


async def test_native_episode_straddling_an_update_carries_two_versions(
    straddling: BumpAfterFirstCall, zoom_env: str, zoom_row: dict[str, Any]
) -> None:
    model = NativeModel(
        straddling, straddling.codec, max_model_len=straddling.max_model_len, sampling=SAMPLING
    )
    result = await run_episode(straddling, zoom_env, zoom_row, max_turns=2, model=model)
    assert item_versions(result) == [0, 1]
    traj = from_gym_result(result)
    assert [t.policy_version for t in traj.turns] == [0, 1]
    assert traj.policy_versions == [0, 1]
    assert traj.oldest_policy_version == 0


async def test_model_server_episode_straddling_an_update_carries_two_versions(
    straddling: BumpAfterFirstCall, zoom_env: str, zoom_row: dict[str, Any]
) -> None:
    result = await run_via_model_server(
        straddling, zoom_env, zoom_row, max_steps=2, max_model_len=straddling.max_model_len
    )
    assert item_versions(result) == [0, 1]
    traj = from_gym_result(result)
    assert traj.policy_versions == [0, 1]
    assert traj.oldest_policy_version == 0
