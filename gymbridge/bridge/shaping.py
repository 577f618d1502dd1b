"""Toy reward shaping for demos and smoke runs.

:class:`TokenRateShaping` is a **dense toy shaping reward**, honest about what it is: the
fraction of a trajectory's *generated* tokens whose text consists only of characters from a
given set (default: digits), times ``weight``, **added** to the environment's reward. It
exists so that a random-weight model, which never solves a real task (every GRPO group has
zero reward variance, zero advantages, zero gradient), still gives the loop a signal it can
visibly climb within a few steps. It is plugged in through the bridge's ``reward_fn`` hook,
so the environment's own reward stays in ``metadata["env_reward"]`` and the bonus is the
``"shaping"`` reward component; nothing about the environment's verdict is changed.

The sampling seeds of a rollout (:func:`~gymbridge.generation.seeding.rollout_seed`,
:class:`~gymbridge.generation.seeding.PromptSeededGenerator`) are the generation layer's.

Invariants: shaping values are finite and in ``[0, weight]`` for a non-negative weight; a
trajectory without generated tokens gets 0.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import Field

from gymbridge.config import StrictModel
from gymbridge.trajectory.types import Trajectory

logger = logging.getLogger(__name__)

__all__ = ["ShapingConfig", "TokenRateShaping"]


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
