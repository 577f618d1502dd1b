"""Per-rollout sampling seeds: reruns with the same seed draw the same samples.

:func:`rollout_seed` derives the sampling seed of one rollout from ``(seed, task index,
rollout index)`` (a hash, so the G rollouts of a prompt differ while a rerun with the same
seed draws the same samples). :class:`PromptSeededGenerator` does the same for a path where
the rollout index never reaches the generator (the Gym path: agent -> model server): a call
without a seed gets one derived from ``(seed, digest of the prompt tokens, how many times
this exact prompt was seen before)``; reruns then draw the same *set* of samples for a group
(which rollout index gets which one follows arrival order). A backend that samples each row
from its own stream (:class:`~gymbridge.generation.types.RowSeededGenerator`: HF, vLLM) gets
the whole call at once with per-row seeds; any other gets one row per call (it seeds a whole
batch), which trades batching for reproducibility.

Invariants: seeds are non-negative 63-bit integers; a call that carries its own ``seed`` passes
through unchanged; the per-prompt counts are bounded (:attr:`PromptSeededGenerator.prompts_held`
prompts, least recently seen forgotten first), so a long run over a large dataset holds a fixed
amount: a prompt met again after that many others starts its count afresh (its seeds repeat,
drawn from the weights of that later step).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from gymbridge.generation.types import (
    Generation,
    Generator,
    SamplingConfig,
    row_seeded,
    wrapped_policy_version,
)
from gymbridge.trajectory.types import GenerationInput

__all__ = ["PromptSeededGenerator", "rollout_seed"]


def rollout_seed(seed: int, task_index: int, rollout_index: int) -> int:
    """A sampling seed for one rollout: a hash of ``(seed, task_index, rollout_index)``, 63 bits."""
    digest = hashlib.sha256(f"gymbridge-rollout:{seed}:{task_index}:{rollout_index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class PromptSeededGenerator:
    """Wrap a :class:`~gymbridge.generation.Generator`: unseeded calls get per-prompt seeds.

    See the module docstring. Calls that carry their own ``seed`` pass through unchanged.
    Attributes of the wrapped generator (``codec``, ``max_model_len``, ...) are forwarded.
    """

    def __init__(self, generator: Generator, seed: int) -> None:
        self.generator = generator
        self.seed = seed
        self._seen: dict[bytes, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.generator, name)

    policy_version = wrapped_policy_version("generator")

    prompts_held = 16_384
    """Prompts whose count is kept (least recently seen forgotten first; module docstring)."""

    def _seed_for(self, prompt: Sequence[int]) -> int:
        digest = hashlib.sha256(b",".join(str(t).encode() for t in prompt)).digest()
        k = self._seen.pop(digest, 0)
        self._seen[digest] = k + 1  # re-inserted: the dict's order is least recently seen first
        if len(self._seen) > self.prompts_held:
            del self._seen[next(iter(self._seen))]
        return rollout_seed(self.seed, int.from_bytes(digest[:8], "big"), k)

    async def generate(self, inputs: Sequence[GenerationInput], sampling: SamplingConfig) -> list[Generation]:
        if sampling.seed is not None:
            return await self.generator.generate(inputs, sampling)
        return await self.generate_rows(inputs, sampling, [None] * len(inputs))

    async def generate_rows(
        self, inputs: Sequence[GenerationInput], sampling: SamplingConfig, seeds: Sequence[int | None]
    ) -> list[Generation]:
        """Rows without a seed get their prompt's seed; rows with one keep it (defined here, never
        forwarded: the wrapped generator's own ``generate_rows`` would skip the prompt seeds)."""
        # in call order, no await between
        filled = [
            self._seed_for(inp.prompt_token_ids) if s is None else s
            for inp, s in zip(inputs, seeds, strict=True)
        ]
        if row_seeded(self.generator):
            return list(await self.generator.generate_rows(inputs, replace(sampling, seed=None), filled))
        out: list[Generation] = []
        for inp, seed in zip(inputs, filled, strict=True):
            out.extend(await self.generator.generate([inp], replace(sampling, seed=seed)))
        return out
