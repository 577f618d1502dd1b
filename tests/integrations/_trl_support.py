"""Helpers of the TRL adapter tests: a spying trainer and parameter snapshots.

The tiny model as TRL sees it and the format warm-up are :mod:`gymbridge.testing.trl_format`
(``examples/train_trl.py`` uses them too), re-exported here. :func:`spying_trainer` builds a real
``GRPOTrainer`` whose training forwards record how many images they carried.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from gymbridge.testing.trl_format import (
    TinyForTRL,
    encode,
    encode_after_tool,
    one_torch_thread,
    tiny_for_trl,
    tool_call,
    warm_up,
)

__all__ = [
    "LOOK_CALL",
    "ForwardSpy",
    "TinyForTRL",
    "changed",
    "encode",
    "encode_after_tool",
    "one_torch_thread",
    "spying_trainer",
    "tiny_for_trl",
    "vision_params",
    "warm_up",
]

LOOK_CALL = tool_call("look")


@dataclass
class ForwardSpy:
    """Images carried by each training forward (``GRPOTrainer._get_per_token_logps_and_entropies``)."""

    images_per_forward: list[int] = field(default_factory=list)


def spying_trainer(spy: ForwardSpy, **kwargs: Any) -> Any:
    """A real ``GRPOTrainer`` whose per-token-logprob forwards record their ``image_grid_thw`` rows."""
    from trl import GRPOTrainer

    class SpyingGRPOTrainer(GRPOTrainer):  # type: ignore[misc]
        def _get_per_token_logps_and_entropies(self, model: Any, *args: Any, **forward: Any) -> Any:
            grid = forward.get("image_grid_thw")
            spy.images_per_forward.append(0 if grid is None else int(grid.shape[0]))
            return super()._get_per_token_logps_and_entropies(model, *args, **forward)

    return SpyingGRPOTrainer(**kwargs)


def vision_params(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".visual." in f".{n}"}


def changed(before: dict[str, torch.Tensor], model: Any) -> list[str]:
    now = dict(model.named_parameters())
    return [n for n, p in before.items() if not torch.equal(p, now[n].detach())]
