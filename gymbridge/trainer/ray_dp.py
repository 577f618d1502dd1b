"""Data-parallel GRPO: Ray actors in one torch.distributed group, gradients reduced inside it.

:class:`RayDPTrainer` (the driver's side) runs ``num_workers`` :class:`DPWorker` actors, each with a
policy copy from ``model_factory``, in **one** ``torch.distributed`` group (gloo on CPU, NCCL when
the actors hold a GPU), separate from the weight-sync group of :mod:`gymbridge.trainer.weight_sync`.
:func:`init_ray` starts a local Ray or joins a cluster; Ray is imported lazily (a missing ``ray``
raises ``ImportError`` naming the ``ray`` extra).

A step: the driver shards the batch (``batch.shard``: whole groups where possible, balanced by
tokens; floating media cast to the policy's dtype) and sends each worker its shard; each worker
accumulates its gradients with ``GRPOTrainer.compute_gradients`` and all-reduces them once, in
bounded buckets; the driver runs the drift guard on the returned metrics; then every worker clips
and steps its own AdamW, and rank 0 alone returns its weights, which the driver loads and publishes.

Invariants:

* the shards' gradients sum to the full-batch gradient (every worker divides by the whole batch's
  normaliser), so ``dp_workers`` 0, 1 and 2 train the same step;
* the driver never holds a gradient; it receives metrics, and rank 0's weights once per step;
* every worker holds the same weights after a step (:meth:`RayDPTrainer.param_digests` checks it);
* a drifted step raises :class:`~gymbridge.errors.PolicyDriftError` before any worker moves, and
  a worker whose shard fails tells its peers before the reduction, so nobody waits on a collective
  that never comes.

The step in detail and why this is an explicit all-reduce rather than DDP or FSDP2: docs/dp.md.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from gymbridge.errors import PolicyDriftError, TrainingError
from gymbridge.trainer.grpo import (
    GradientResult,
    GRPOConfig,
    GRPOTrainer,
    StepMetrics,
    log_skipped_step,
    loss_rows,
    skip_reason,
    summarize,
)

if TYPE_CHECKING:
    from gymbridge.metrics import PayloadMeter
    from gymbridge.tensors import TrainBatch

logger = logging.getLogger(__name__)

__all__ = ["DPWorker", "RayDPTrainer", "init_ray", "param_digest", "policy_shards", "require_ray"]

REDUCE_BUCKET_BYTES = 64 << 20
"""Largest flat buffer one gradient all-reduce moves."""


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


def init_ray(num_cpus: int = 2, *, address: str | None = None) -> Any:
    """Start (or reuse) Ray and return ``ray``.

    ``address`` (a run's ``dp.ray_address``, e.g. ``"auto"`` or ``"ray://head:10001"``) joins an
    existing cluster; without it a local Ray starts with ``num_cpus`` CPUs, no dashboard and
    ``RAY_AUTH_MODE=disabled``.
    """
    ray = require_ray()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if not ray.is_initialized():
        if address is not None:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        else:
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


def _to_cpu(value: Any) -> Any:
    """``value`` (a state dict, nested) with every tensor on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


def policy_shards(batch: TrainBatch, num_workers: int, dtype: torch.dtype) -> list[TrainBatch]:
    """What crosses to the workers: ``batch.shard(num_workers)`` with floating media cast to ``dtype``.

    ``batch`` itself is not changed (the Gym's return keeps its dtype).
    """
    return [s.cast_media(dtype) for s in batch.shard(num_workers, group_aware=True)]


class DPWorker:
    """The body of one Ray actor: a policy copy, its own trainer and optimizer, one rank of the group."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        model_factory: Callable[[], Any],
        config: GRPOConfig,
        dtype: torch.dtype,
    ) -> None:
        torch.set_num_threads(1)
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model = model_factory().to(device=self.device, dtype=dtype)
        self.trainer = GRPOTrainer(model, config)
        self._grads: list[torch.Tensor] | None = None

    def node_address(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]  # ray ships it untyped

    def free_port(self, host: str) -> int:
        """A free TCP port on ``host`` for the group's store (rank 0 hosts it)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])

    def join(self, host: str, port: int, backend: str, timeout_s: float) -> str:
        """Join the DP group at ``tcp://host:port`` as this worker's rank; returns the backend."""
        import torch.distributed as dist

        dist.init_process_group(
            backend,
            init_method=f"tcp://{host}:{port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        return str(dist.get_backend())

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ state

    def load(self, state: dict[str, Any]) -> None:
        """Weights, optimizer state and step count (the driver's: at start and after a resume)."""
        self.trainer.model.load_state_dict(state["model"])
        if state["optimizer"]["state"]:
            self.trainer.optimizer.load_state_dict(state["optimizer"])
        else:  # a fresh driver optimizer: a fresh one here too (no momentum left from before)
            self.trainer = GRPOTrainer(self.trainer.model, self.trainer.config)
        self.trainer.steps = int(state["steps"])
        if state.get("reference") is not None and self.trainer.reference is not None:
            self.trainer.reference.load_state_dict(state["reference"])  # the driver's (a resumed run's)
        self._grads = None

    def optimizer_state(self) -> dict[str, Any]:
        return dict(_to_cpu(self.trainer.optimizer.state_dict()))

    def digest(self) -> str:
        return param_digest(self.trainer.model)

    # ------------------------------------------------------------------ a step

    def compute(
        self, shard: TrainBatch, total_loss_tokens: int, total_loss_rows: int | None = None
    ) -> GradientResult | None:
        """This shard's gradients, all-reduced over the group; returns metrics only (no gradients).

        ``None``: a peer's shard failed (that worker raises); nothing is kept.
        """
        import torch.distributed as dist

        from gymbridge.generation.weights import bucket_tensors, plan_buckets, unbucket

        self._grads = None
        error: BaseException | None = None
        result: GradientResult | None = None
        try:
            result = self.trainer.compute_gradients(
                shard, total_loss_tokens=total_loss_tokens, total_loss_rows=total_loss_rows
            )
        except Exception as exc:  # told to the peers first, raised below
            error = exc
        failed = torch.tensor([0.0 if error is None else 1.0], device=self.device)
        dist.all_reduce(failed)
        if float(failed) > 0 or result is None:
            if error is not None:
                raise error
            return None
        grads = result.grads
        named = [(str(i), g) for i, g in enumerate(grads)]
        for bucket in plan_buckets(named, REDUCE_BUCKET_BYTES):
            flat = bucket_tensors(bucket, [grads[int(s.name)] for s in bucket.specs], self.device)
            dist.all_reduce(flat)
            for spec, view in unbucket(bucket, flat):
                grads[int(spec.name)].copy_(view)
        self._grads = grads
        return replace(result, grads=[])

    def discard(self) -> None:
        """Drop the reduced gradients (the driver's drift guard refused the step)."""
        self._grads = None

    def apply(self, send_weights: bool) -> tuple[float, dict[str, torch.Tensor] | None]:
        """Clip and step with the reduced gradients; returns the pre-clip norm and, if asked, the weights."""
        if self._grads is None:
            raise TrainingError(f"DP worker {self.rank}: apply() without reduced gradients")
        norm = self.trainer.apply_gradients(self._grads)
        self._grads = None
        weights = dict(_to_cpu(self.trainer.model.state_dict())) if send_weights else None
        return norm, weights


class RayDPTrainer:
    """GRPO steps over ``num_workers`` Ray actors in one torch.distributed group; see the module docstring.

    ``trainer`` is the driver's: its policy is the one published to the generator (rank 0's
    weights after every step) and its weights, optimizer state and step count seed the workers.
    ``num_gpus``: GPUs per actor (``None``: 1 when the cluster has one per worker, else 0).
    """

    def __init__(
        self,
        trainer: GRPOTrainer,
        model_factory: Callable[[], Any],
        num_workers: int,
        *,
        meter: PayloadMeter | None = None,
        worker_num_cpus: float = 1.0,
        num_gpus: float | None = None,
        timeout_s: float = 300.0,
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
        if num_gpus is None:
            num_gpus = 1.0 if float(ray.cluster_resources().get("GPU", 0.0)) >= num_workers else 0.0
        self.num_gpus = num_gpus
        self.dtype = next(trainer.model.parameters()).dtype
        actor = ray.remote(DPWorker).options(num_cpus=worker_num_cpus, num_gpus=num_gpus)
        self.workers = [
            actor.remote(rank, num_workers, model_factory, trainer.config, self.dtype)
            for rank in range(num_workers)
        ]
        nodes = ray.get([w.node_address.remote() for w in self.workers])
        host = "127.0.0.1" if len(set(nodes)) == 1 else str(nodes[0])
        port = ray.get(self.workers[0].free_port.remote(host))
        backend = "nccl" if num_gpus > 0 and torch.distributed.is_nccl_available() else "gloo"
        joined = ray.get([w.join.remote(host, port, backend, timeout_s) for w in self.workers])
        self.backend: str = joined[0]
        self.last_shard_tokens: list[int] = []
        """Sequence tokens of each worker's shard in the latest step."""
        self.last_media_dtypes: dict[str, str] = {}
        """The dtype of each media key as the latest step's shards crossed to the workers."""
        self.last_weights_s = 0.0
        """Seconds of the latest step from "apply" until the driver held rank 0's new weights."""
        self.sync_workers()
        logger.info("started %d Ray DP worker(s), %s group at %s:%d", num_workers, self.backend, host, port)

    def sync_workers(self) -> None:
        """Give every worker the driver's weights, optimizer state and step count."""
        state = {
            "model": {k: v.detach().cpu() for k, v in self.trainer.model.state_dict().items()},
            "optimizer": _to_cpu(self.trainer.optimizer.state_dict()),
            "steps": self.trainer.steps,
            "reference": None
            if self.trainer.reference is None
            else {k: v.detach().cpu() for k, v in self.trainer.reference.state_dict().items()},
        }
        ref = self.ray.put(state)
        self.ray.get([w.load.remote(ref) for w in self.workers])

    def pull_optimizer_state(self) -> None:
        """Load rank 0's optimizer state into the driver's (every worker's is the same): for checkpoints.

        The driver's weights already are rank 0's (loaded after every step).
        """
        self.trainer.optimizer.load_state_dict(self.ray.get(self.workers[0].optimizer_state.remote()))

    def step(self, batch: TrainBatch) -> StepMetrics:
        started = time.perf_counter()
        batch, truncated = self.trainer.prepare(batch)  # the whole batch's loss mask, before the split
        skipped = skip_reason(batch, self.trainer.config)
        if skipped is not None:  # no learning signal: no worker steps, weights stay identical
            log_skipped_step(batch, skipped)
            return summarize(
                batch, [], 0.0, time.perf_counter() - started, truncated_masked=truncated, skipped=skipped
            )
        shards = policy_shards(batch, self.num_workers, self.dtype)
        self.last_shard_tokens = [s.num_tokens for s in shards]
        self.last_media_dtypes = {
            k: str(v.dtype).removeprefix("torch.")
            for s in shards
            for k, v in s.media.items()
            if v.num_segments
        }
        if self.meter is not None:
            for i, shard in enumerate(shards):
                self.meter.record("policy_shard", shard, shard=i)
        total = int(batch.loss_mask.sum())
        rows = loss_rows(batch.loss_mask)
        got = self.ray.get(
            [w.compute.remote(s, total, rows) for w, s in zip(self.workers, shards, strict=True)]
        )
        parts: list[GradientResult] = [p for p in got if p is not None]
        if len(parts) != len(got):  # a failing worker raises; reaching here means one returned early
            raise TrainingError("a DP worker dropped its gradients without an error")
        lead = next((p for p in parts if p.loss_tokens), None)
        if lead is not None:
            try:
                self.trainer.check_drift(lead)  # before any worker moves
            except PolicyDriftError:
                self.ray.get([w.discard.remote() for w in self.workers])
                raise
        applied = time.perf_counter()
        lr = self.trainer.config.lr_at(self.trainer.steps + 1)  # what every worker's apply uses
        outs = self.ray.get([w.apply.remote(rank == 0) for rank, w in enumerate(self.workers)])
        norm, weights = outs[0]
        assert weights is not None
        with torch.no_grad():
            self.trainer.model.load_state_dict(weights)
        self.last_weights_s = time.perf_counter() - applied
        self.trainer.steps += 1
        return summarize(
            batch,
            parts,
            norm,
            time.perf_counter() - started,
            truncated_masked=truncated,
            lr=lr,
            optimizer_s=self.last_weights_s,  # the workers' updates and rank 0's weights back here
        )

    def param_digests(self) -> list[str]:
        """The driver's parameter digest followed by every worker's (all equal when in sync)."""
        return [param_digest(self.trainer.model), *self.ray.get([w.digest.remote() for w in self.workers])]

    def shutdown(self) -> None:
        if self.workers:
            try:
                self.ray.get([w.close.remote() for w in self.workers], timeout=30)
            except Exception:  # a dead actor: killed below anyway
                logger.debug("closing the DP group failed", exc_info=True)
        for w in self.workers:
            self.ray.kill(w)
        self.workers = []
