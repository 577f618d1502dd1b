"""The public API of gymbridge.generation and gymbridge.rollout: sorted, importable, stable names."""

from __future__ import annotations

import gymbridge.generation as generation
import gymbridge.rollout as rollout

STABLE = {"Generator", "GenerationInput", "HFGenerator", "VLLMGenerator", "SamplingConfig", "Generation"}


def test_all_is_sorted_and_every_name_resolves() -> None:
    for module in (generation, rollout):
        assert list(module.__all__) == sorted(module.__all__)
        for name in module.__all__:
            assert getattr(module, name) is not None, name
    assert set(generation.__all__) >= STABLE
    assert "run_episode" in rollout.__all__


def test_generation_input_is_the_trajectory_layers() -> None:
    from gymbridge.trajectory import GenerationInput

    assert generation.GenerationInput is GenerationInput


def test_hf_generator_satisfies_the_protocol(tiny_gen: generation.HFGenerator) -> None:
    assert isinstance(tiny_gen, generation.Generator)
