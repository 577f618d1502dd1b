"""InProcessPublisher: the trainer's weights land in the generator's own model, with the version."""

from __future__ import annotations

import pytest
import torch

from gymbridge.errors import WeightSyncError
from gymbridge.generation.hf import HFGenerator
from gymbridge.generation.types import SamplingConfig
from gymbridge.models.tiny_vlm import build_tiny_vlm
from gymbridge.trainer.models import tiny_policy
from gymbridge.trainer.weight_sync import InProcessPublisher, WeightPublisher
from gymbridge.trajectory.types import GenerationInput


def own_generator(seed: int = 0) -> HFGenerator:
    return HFGenerator(tiny_policy(seed), build_tiny_vlm(seed).processor)


def nudge(model: torch.nn.Module, by: float = 0.05) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


def test_publish_copies_into_the_generators_own_model_and_sets_the_version() -> None:
    gen = own_generator()
    trainer_model = tiny_policy(0)
    nudge(trainer_model)
    publisher: WeightPublisher = InProcessPublisher(gen)
    seconds = publisher.publish(trainer_model, 1)
    assert seconds >= 0.0
    assert gen.policy_version == 1
    assert gen.model is not trainer_model
    for (name, a), b in zip(trainer_model.state_dict().items(), gen.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


async def test_generations_after_a_publish_carry_the_new_version() -> None:
    gen = own_generator()
    inp = GenerationInput(prompt_token_ids=gen.codec.encode("hello"))
    sampling = SamplingConfig(temperature=0.0, max_tokens=2)
    (before,) = await gen.generate([inp], sampling)
    InProcessPublisher(gen).publish(tiny_policy(0), 3)
    (after,) = await gen.generate([inp], sampling)
    assert (before.policy_version, after.policy_version) == (0, 3)


def test_a_generator_sharing_the_trainers_model_only_advances_its_version() -> None:
    gen = own_generator()
    InProcessPublisher(gen).publish(gen.model, 2)
    assert gen.policy_version == 2


def test_an_older_version_is_refused() -> None:
    gen = own_generator()
    publisher = InProcessPublisher(gen)
    publisher.publish(tiny_policy(0), 2)
    with pytest.raises(WeightSyncError, match="older"):
        publisher.publish(tiny_policy(0), 1)


def test_a_model_of_another_layout_is_refused_and_nothing_is_copied() -> None:
    gen = own_generator()
    before = {k: v.clone() for k, v in gen.model.state_dict().items()}
    other = torch.nn.Linear(3, 3)
    with pytest.raises(WeightSyncError, match="does not match"):
        InProcessPublisher(gen).publish(other, 1)
    assert gen.policy_version == 0
    assert all(torch.equal(before[k], v) for k, v in gen.model.state_dict().items())
