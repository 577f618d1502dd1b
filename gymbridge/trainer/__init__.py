"""The reference GRPO trainer (CPU-capable) and its Ray data-parallel workers.

Public API (stable): :class:`GRPOTrainer`, :class:`GRPOConfig`, :class:`StepMetrics`,
:func:`token_logprobs`, :func:`grpo_token_loss`, :class:`RayDPTrainer`, :func:`init_ray`,
:func:`param_digest`, :func:`tiny_policy`; weight publication: :class:`WeightPublisher`,
:class:`InProcessPublisher`, :class:`DistributedPublisher`; checkpoints:
:func:`save_checkpoint` / :func:`load_checkpoint`.
Ray is imported only when a :class:`RayDPTrainer` is made.

Invariant: nothing here imports the bridge or the run (:mod:`gymbridge.run`: the recipe, the run
directory, the generator's placement); the run imports the trainer. The trainer takes
:class:`~gymbridge.tensors.TrainBatch` es, from whatever made them.
"""

from __future__ import annotations

from gymbridge.trainer.checkpoint import RunState, load_checkpoint, save_checkpoint
from gymbridge.trainer.grpo import (
    GradientResult,
    GRPOConfig,
    GRPOTrainer,
    StepMetrics,
    grpo_token_loss,
    media_kwargs,
    summarize,
    token_logprobs,
)
from gymbridge.trainer.models import from_config, tiny_policy
from gymbridge.trainer.ray_dp import DPWorker, RayDPTrainer, init_ray, param_digest, require_ray
from gymbridge.trainer.weight_sync import DistributedPublisher, InProcessPublisher, WeightPublisher

__all__ = [
    "DPWorker",
    "DistributedPublisher",
    "GRPOConfig",
    "GRPOTrainer",
    "GradientResult",
    "InProcessPublisher",
    "RayDPTrainer",
    "RunState",
    "StepMetrics",
    "WeightPublisher",
    "from_config",
    "grpo_token_loss",
    "init_ray",
    "load_checkpoint",
    "media_kwargs",
    "param_digest",
    "require_ray",
    "save_checkpoint",
    "summarize",
    "tiny_policy",
    "token_logprobs",
]
