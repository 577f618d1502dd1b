"""Toy shaping (``TokenRateShaping``) and sampling seeds (``rollout_seed``, ``PromptSeededGenerator``)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gymbridge.bridge import PromptSeededGenerator, ShapingConfig, TokenRateShaping, rollout_seed
from gymbridge.bridge.sources import NativeRollouts
from gymbridge.generation.types import Generation, SamplingConfig
from gymbridge.models.tiny_vlm import build_tiny_vlm
from gymbridge.trajectory.types import GenerationInput, Trajectory, Turn


def traj(generated: list[list[int]], reward: float = 0.0) -> Trajectory:
    turns = [
        Turn(
            index=i,
            item_index=i,
            kind="message",
            segment=0,
            prompt_token_ids=[1],
            generation_token_ids=g,
            generation_logprobs=[0.0] * len(g),
        )
        for i, g in enumerate(generated)
    ]
    return Trajectory(turns=turns, reward=reward)


@pytest.fixture(scope="module")
def shaping() -> TokenRateShaping:
    return TokenRateShaping(build_tiny_vlm(0).tokenizer, "0123456789", weight=0.5)


def test_token_rate_counts_digit_tokens_over_every_turn(shaping: TokenRateShaping) -> None:
    tok = build_tiny_vlm(0).tokenizer
    digits = [tok.convert_tokens_to_ids(c) for c in "0123456789"]
    assert set(digits) <= shaping.token_ids
    assert all(tok.decode([t]).isdigit() for t in shaping.token_ids)
    letter = tok.convert_tokens_to_ids("a")
    assert letter not in shaping.token_ids
    t = traj([[digits[0], letter], [digits[3], letter]], reward=1.0)
    assert shaping.bonus(t) == pytest.approx(0.5 * 2 / 4)
    assert shaping(t) == pytest.approx(1.0 + 0.25)  # added to the env reward, never replacing it
    assert shaping(traj([[]], reward=0.0)) == 0.0  # no generated tokens: no bonus
    special = set(tok.all_special_ids)
    assert not special & shaping.token_ids


def test_shaping_config_and_refusals() -> None:
    tok = build_tiny_vlm(0).tokenizer
    assert TokenRateShaping.from_config(ShapingConfig(kind="none"), tok) is None
    assert ShapingConfig().kind == "none"  # opt-in
    made = TokenRateShaping.from_config(ShapingConfig(kind="token_rate", tokens="0", weight=2.0), tok)
    assert made is not None and made.weight == 2.0 and len(made.token_ids) >= 1
    with pytest.raises(ValueError, match="no token"):
        TokenRateShaping(tok, "\u2603")


@given(st.integers(0, 2**31), st.integers(0, 10_000), st.integers(0, 63))
def test_rollout_seeds_are_stable_distinct_and_in_range(seed: int, task: int, rollout: int) -> None:
    s = rollout_seed(seed, task, rollout)
    assert s == rollout_seed(seed, task, rollout) and 0 <= s < 2**63
    assert s != rollout_seed(seed, task, rollout + 1)
    assert s != rollout_seed(seed + 1, task, rollout)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[list[list[int]], SamplingConfig]] = []
        self.codec = "the codec"

    async def generate(self, inputs: Sequence[GenerationInput], sampling: SamplingConfig) -> list[Generation]:
        self.calls.append(([list(i.prompt_token_ids) for i in inputs], sampling))
        return [Generation([7], [-0.1], "length", list(i.prompt_token_ids)) for i in inputs]


async def test_prompt_seeded_generator_gives_repeats_of_a_prompt_distinct_reproducible_seeds() -> None:
    def seeds(rec: Recorder) -> list[int | None]:
        return [s.seed for _, s in rec.calls]

    inputs = [GenerationInput([1, 2, 3]), GenerationInput([1, 2, 3]), GenerationInput([4])]
    a, b = Recorder(), Recorder()
    out = await PromptSeededGenerator(a, 0).generate(inputs, SamplingConfig())
    await PromptSeededGenerator(b, 0).generate(inputs, SamplingConfig())
    assert len(out) == 3 and all(len(c[0]) == 1 for c in a.calls)  # one row per seeded call
    assert seeds(a) == seeds(b) and len(set(seeds(a))) == 3
    c = Recorder()
    await PromptSeededGenerator(c, 1).generate(inputs, SamplingConfig())
    assert seeds(c) != seeds(a)
    wrapped = PromptSeededGenerator(c, 1)
    await wrapped.generate(inputs[:1], SamplingConfig(seed=42))  # an explicit seed passes through
    assert c.calls[-1][1].seed == 42 and wrapped.codec == "the codec"


def test_native_rollouts_seed_each_rollout_from_seed_task_and_index() -> None:
    src = NativeRollouts(Recorder(), "http://127.0.0.1:9", seed=3)
    row = {"responses_create_params": {"temperature": 0.7, "max_output_tokens": 12}}
    s = src._seeded(row, rollout_seed(3, 5, 1))
    assert (s.temperature, s.top_p, s.max_tokens, s.seed) == (0.7, 1.0, 12, rollout_seed(3, 5, 1))
