"""Per-prompt seeds: reruns draw the same seeds, and the per-prompt counts stay bounded."""

from __future__ import annotations

from typing import Any

import pytest

from gymbridge.generation.seeding import PromptSeededGenerator
from gymbridge.generation.types import Generation, SamplingConfig
from gymbridge.trajectory.types import GenerationInput


class _Recorder:
    policy_version = 0

    def __init__(self) -> None:
        self.seeds: list[int | None] = []

    async def generate(self, rows: Any, sampling: SamplingConfig) -> list[Generation]:
        self.seeds.append(sampling.seed)
        return [Generation(token_ids=[1], logprobs=[0.0], finish_reason="stop") for _ in rows]


async def _seeds(gen: PromptSeededGenerator, prompts: list[int]) -> list[int | None]:
    rec = gen.generator
    assert isinstance(rec, _Recorder)
    before = len(rec.seeds)
    for p in prompts:
        await gen.generate([GenerationInput(prompt_token_ids=[p, 7])], SamplingConfig(temperature=1.0))
    return rec.seeds[before:]


async def test_a_prompts_samples_differ_and_a_rerun_draws_the_same_seeds() -> None:
    a = await _seeds(PromptSeededGenerator(_Recorder(), 5), [1, 1, 1, 2])
    b = await _seeds(PromptSeededGenerator(_Recorder(), 5), [1, 1, 1, 2])
    assert a == b and len(set(a)) == 4


async def test_per_prompt_counts_are_bounded_and_the_least_recent_is_forgotten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run over 10,000 distinct prompts holds ``prompts_held`` counts, not 10,000; a prompt seen
    recently keeps its count, one forgotten starts afresh."""
    monkeypatch.setattr(PromptSeededGenerator, "prompts_held", 100)
    gen = PromptSeededGenerator(_Recorder(), 5)
    first = await _seeds(gen, [0, 1])
    others = list(range(2, 10_000))
    # prompt 1 is met again every 50 others (recent: kept), prompt 0 never (forgotten)
    await _seeds(gen, [p for i in range(0, len(others), 50) for p in [*others[i : i + 50], 1]])
    assert len(gen._seen) == 100
    again = await _seeds(gen, [1, 0])
    fresh = await _seeds(PromptSeededGenerator(_Recorder(), 5), [1] * 202 + [0])
    assert again[0] == fresh[201]  # prompt 1's 202nd sample: its count was kept all along
    assert again[1] == first[0] == fresh[202]  # prompt 0 was forgotten: its count restarted
