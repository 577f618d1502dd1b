"""Toy reward shaping and per-rollout sampling seeds for demos and smoke runs.

:class:`TokenRateShaping` is a **dense toy shaping reward**, honest about what it is: the
fraction of a trajectory's *generated* tokens whose text consists only of characters from a
given set (default: digits), times ``weight``, **added** to the environment's reward. It
exists so that a random-weight model, which never solves a real task (every GRPO group has
zero reward variance, zero advantages, zero gradient), still gives the loop a signal it can
visibly climb within a few steps. It is plugged in through the bridge's ``reward_fn`` hook,
so the environment's own reward stays in ``metadata["env_reward"]`` and the bonus is the
``"shaping"`` reward component; nothing about the environment's verdict is changed.

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

Invariants: shaping values are finite and in ``[0, weight]`` for a non-negative weight; a
trajectory without generated tokens gets 0; seeds are non-negative 63-bit integers.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any, Literal

from pydantic import Field

from gymbridge.config import StrictModel
from gymbridge.generation.types import (
    Generation,
    Generator,
    SamplingConfig,
    row_seeded,
    wrapped_policy_version,
)
from gymbridge.trajectory.types import GenerationInput, Trajectory

logger = logging.getLogger(__name__)

__all__ = [
    "PromptSeededGenerator",
    "ShapingConfig",
    "TokenRateShaping",
    "rollout_seed",
]


class ShapingConfig(StrictModel):
    """A run's ``shaping:`` section (off by default; ``kind: token_rate`` turns the toy shaping on)."""

    kind: Literal["none", "token_rate"] = "none"
    tokens: str = Field("0123456789", min_length=1)
    """``token_rate``: a generated token counts when its text is non-empty and uses only these characters."""
    weight: float = 1.0
    """The bonus is ``weight * rate``, added to the environment's reward."""


class TokenRateShaping:
    """``reward_fn``: env reward + ``weight`` x (fraction of generated tokens made of ``chars``).

    ``tokenizer`` decodes each vocabulary id once (``decode([id])``); ids whose text is
    non-empty and uses only ``chars`` form :attr:`token_ids`. Special tokens never count.
    """

    def __init__(self, tokenizer: Any, chars: str = "0123456789", *, weight: float = 1.0) -> None:
        if not chars:
            raise ValueError("chars must not be empty")
        self.chars = chars
        self.weight = float(weight)
        allowed = set(chars)
        special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else None
        vocab_size = max(vocab.values()) + 1 if vocab else int(tokenizer.vocab_size)
        ids: set[int] = set()
        for i in range(vocab_size):
            if i in special:
                continue
            text = tokenizer.decode([i])
            if text and all(c in allowed for c in text):
                ids.add(i)
        if not ids:
            raise ValueError(f"no token of this tokenizer is made only of {chars!r}: the shaping would be 0")
        self.token_ids: frozenset[int] = frozenset(ids)

    @classmethod
    def from_config(cls, config: ShapingConfig, tokenizer: Any) -> TokenRateShaping | None:
        """The shaping a config asks for (``None`` for ``kind: none``)."""
        if config.kind == "none":
            return None
        return cls(tokenizer, config.tokens, weight=config.weight)

    def rate(self, generated: Iterable[int]) -> float:
        """Fraction of ``generated`` ids in :attr:`token_ids` (0 for no tokens)."""
        toks = list(generated)
        if not toks:
            return 0.0
        return sum(1 for t in toks if t in self.token_ids) / len(toks)

    def bonus(self, traj: Trajectory) -> float:
        """``weight * rate`` over every generated token of every turn of ``traj``."""
        return self.weight * self.rate(t for turn in traj.turns for t in turn.generation_token_ids)

    def __call__(self, traj: Trajectory) -> float:
        return float(traj.reward) + self.bonus(traj)

    def __repr__(self) -> str:
        return f"TokenRateShaping(chars={self.chars!r}, weight={self.weight}, {len(self.token_ids)} ids)"


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

    def _seed_for(self, prompt: Sequence[int]) -> int:
        digest = hashlib.sha256(b",".join(str(t).encode() for t in prompt)).digest()
        k = self._seen.get(digest, 0)
        self._seen[digest] = k + 1
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
