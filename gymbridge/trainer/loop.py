"""One step of the GRPO training loop: a batch from the bridge, an update, a weight publication.

:func:`train_step` is what the launchers call once per step:

1. set :attr:`~gymbridge.bridge.BridgeIterator.policy_version` to the trainer's version and
   ask the bridge for a batch (with ``max_staleness = k > 0`` the bridge keeps the groups of
   the next ``k`` batches in flight, so their rollouts run during 2. and 3.);
2. run the update **in a worker thread** (``asyncio.to_thread``): the event loop, and with it
   every in-flight rollout and the in-process servers, keeps running while the trainer trains;
3. if the update stepped the optimizer, the policy version becomes ``v + 1`` and ``publish(v + 1)``
   (also in a thread) hands the new weights to the generator; a skipped update (no loss token)
   keeps the version and publishes nothing.

Policy versions: ``0`` is the initial weights; version ``v`` is the weights after ``v`` optimizer
steps. Invariant: when ``publish`` returns, the generator samples from version ``v`` (in-flight
generations finish on the weights they started with; a multi-turn rollout may straddle an
update, and its turns record which versions produced them).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gymbridge.bridge import BridgeIterator
    from gymbridge.tensors import TrainBatch
    from gymbridge.trainer.grpo import StepMetrics

__all__ = ["LoopStep", "train_step"]


@dataclass(frozen=True)
class LoopStep:
    """What one :func:`train_step` did."""

    metrics: StepMetrics
    policy_version: int
    """The trainer's version after the step (the one published, if any)."""
    weight_sync_s: float
    """Seconds ``publish`` took (0.0 when nothing was published)."""
    step_s: float
    """Wall seconds of the whole step: waiting for the batch, training, publishing."""
    batch: TrainBatch
    """The batch this step trained on."""


async def train_step(
    bridge: BridgeIterator,
    update: Callable[[TrainBatch], StepMetrics],
    *,
    policy_version: int,
    publish: Callable[[int], float] | None = None,
) -> LoopStep | None:
    """One loop step at ``policy_version`` (see the module docstring); ``None`` when the data ran out."""
    started = time.perf_counter()
    bridge.policy_version = policy_version
    try:
        batch = await bridge.__anext__()
    except StopAsyncIteration:
        return None
    metrics = await asyncio.to_thread(update, batch)
    sync_s = 0.0
    if metrics.num_loss_tokens > 0:  # the optimizer stepped: a new policy version
        policy_version += 1
        if publish is not None:
            sync_s = await asyncio.to_thread(publish, policy_version)
    return LoopStep(metrics, policy_version, sync_s, time.perf_counter() - started, batch)
