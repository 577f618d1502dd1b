"""Data-parallel GRPO over Ray actors: group-aware shards, summed gradients, identical weights.

The driver keeps the policy (the one generation uses) in a :class:`GRPOTrainer`. Each of
``num_workers`` Ray actors builds its own copy from ``model_factory`` and loads the
driver's weights once. A step:

1. ``batch.shard(num_workers, group_aware=True)``: whole groups per shard where sizes allow,
   each shard holding only the media segments its rows reference, once (the shard is
   pickled with protocol 5 by Ray, tensor storage out of band; ``PayloadMeter`` records
   each at the ``policy_shard`` boundary);
2. every worker computes the gradients of its shard's loss divided by the **whole batch's**
   normaliser (loss tokens, or rows for ``loss_agg: seq_mean_*``; ``mask_truncated`` applied
   to the whole batch first), so the workers' gradients sum exactly to the full-batch gradient;
   with ``kl_coef > 0`` each worker scores against its own frozen reference, the copy of the
   weights it was started with;
3. the driver sums them, clips and applies them with its optimizer, and broadcasts the
   clipped gradients (one ``ray.put``); every worker applies them with its own optimizer,
   whose state evolves identically, so the weights stay identical everywhere
   (:meth:`RayDPTrainer.param_digests` checks it).

The drift guard of :mod:`gymbridge.trainer.grpo` runs on the first shard that holds a loss
token (its first micro-batch), before the driver or any worker applies the step.

Ray is imported lazily: a missing ``ray`` raises ``ImportError`` naming the ``ray`` extra.
:func:`init_ray` starts a local Ray with ``num_cpus`` CPUs, no dashboard and
``RAY_AUTH_MODE=disabled`` unless one is already running.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from gymbridge.trainer.grpo import (
    GradientResult,
    GRPOConfig,
    GRPOTrainer,
    StepMetrics,
    log_skipped_step,
    loss_rows,
    summarize,
)

if TYPE_CHECKING:
    from gymbridge.metrics import PayloadMeter
    from gymbridge.tensors import TrainBatch

logger = logging.getLogger(__name__)

__all__ = ["DPWorker", "RayDPTrainer", "init_ray", "param_digest", "require_ray"]


def require_ray() -> Any:
    """Import Ray or raise an ``ImportError`` that names the extra to install."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            "data-parallel training needs Ray, which is not installed: install the extra with "
            "pip install 'gymbridge[ray]'"
        ) from exc
    return ray


def init_ray(num_cpus: int = 2) -> Any:
    """Start (or reuse) a local Ray: ``num_cpus`` CPUs, no dashboard, auth disabled; returns ``ray``."""
    ray = require_ray()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if not ray.is_initialized():
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=False,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
    return ray


def param_digest(model: Any) -> str:
    """sha256 over every parameter's bytes, in ``named_parameters`` order."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class DPWorker:
    """The body of one Ray actor (also usable in-process): a model copy and its own trainer."""

    def __init__(
        self, model_factory: Callable[[], Any], state_dict: dict[str, torch.Tensor], config: GRPOConfig
    ) -> None:
        torch.set_num_threads(1)
        model = model_factory()
        model.load_state_dict(state_dict)
        self.trainer = GRPOTrainer(model, config)

    def compute(
        self, shard: TrainBatch, total_loss_tokens: int, total_loss_rows: int | None = None
    ) -> GradientResult:
        return self.trainer.compute_gradients(
            shard, total_loss_tokens=total_loss_tokens, total_loss_rows=total_loss_rows
        )

    def apply(self, grads: list[torch.Tensor]) -> None:
        for p, g in zip(self.trainer.params, grads, strict=True):
            p.grad = g.clone()
        self.trainer.optimizer.step()
        self.trainer.optimizer.zero_grad(set_to_none=True)
        self.trainer.steps += 1

    def digest(self) -> str:
        return param_digest(self.trainer.model)


class RayDPTrainer:
    """GRPO steps split over ``num_workers`` Ray actors; see the module docstring."""

    def __init__(
        self,
        trainer: GRPOTrainer,
        model_factory: Callable[[], Any],
        num_workers: int,
        *,
        meter: PayloadMeter | None = None,
        worker_num_cpus: float = 1.0,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        ray = require_ray()
        if not ray.is_initialized():
            init_ray()
        self.ray = ray
        self.trainer = trainer
        self.num_workers = num_workers
        self.meter = meter
        state = {k: v.detach().cpu() for k, v in trainer.model.state_dict().items()}
        state_ref = ray.put(state)
        actor = ray.remote(DPWorker).options(num_cpus=worker_num_cpus)
        self.workers = [actor.remote(model_factory, state_ref, trainer.config) for _ in range(num_workers)]
        logger.info("started %d Ray DP worker(s)", num_workers)

    def step(self, batch: TrainBatch) -> StepMetrics:
        started = time.perf_counter()
        batch, truncated = self.trainer.prepare(batch)  # the whole batch's loss mask, before the split
        shards = batch.shard(self.num_workers, group_aware=True)
        if self.meter is not None:
            for i, shard in enumerate(shards):
                self.meter.record("policy_shard", shard, shard=i)
        total = int(batch.loss_mask.sum())
        rows = loss_rows(batch.loss_mask)
        if total == 0:  # no learning signal: driver and workers all skip, weights stay identical
            log_skipped_step(batch)
            return summarize(batch, [], 0.0, time.perf_counter() - started, truncated_masked=truncated)
        parts: list[GradientResult] = self.ray.get(
            [w.compute.remote(s, total, rows) for w, s in zip(self.workers, shards, strict=True)]
        )
        lead = next((p for p in parts if p.loss_tokens), None)
        if lead is not None:
            self.trainer.check_drift(lead)  # before the driver or any worker moves
        grads = [torch.stack(gs).sum(dim=0) for gs in zip(*(p.grads for p in parts), strict=True)]
        norm = self.trainer.apply_gradients(grads)  # clips grads in place
        grads_ref = self.ray.put(grads)
        self.ray.get([w.apply.remote(grads_ref) for w in self.workers])
        return summarize(batch, parts, norm, time.perf_counter() - started, truncated_masked=truncated)

    def param_digests(self) -> list[str]:
        """The driver's parameter digest followed by every worker's (all equal when in sync)."""
        return [param_digest(self.trainer.model), *self.ray.get([w.digest.remote() for w in self.workers])]

    def shutdown(self) -> None:
        for w in self.workers:
            self.ray.kill(w)
        self.workers = []
