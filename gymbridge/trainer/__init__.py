"""The reference GRPO trainer (CPU-capable), Ray data-parallel workers and the smoke launcher.

Public API (stable): :class:`GRPOTrainer`, :class:`GRPOConfig`, :class:`StepMetrics`,
:func:`token_logprobs`, :func:`grpo_token_loss`, :class:`RayDPTrainer`, :func:`init_ray`,
:func:`param_digest`, :func:`tiny_policy`; weight publication: :class:`WeightPublisher`,
:class:`InProcessPublisher`, :class:`DistributedPublisher`, :class:`GeneratorConfig`; the loop's
pieces: :func:`train_step` (one step: batch, update, weight publication), :class:`RunDir` /
:func:`step_record` (the run directory and its ``metrics.jsonl`` record), :func:`save_checkpoint` /
:func:`load_checkpoint`; the launcher lives in
:mod:`gymbridge.trainer.smoke` (``gymbridge smoke``). Ray is imported only when a
:class:`RayDPTrainer` is made.
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
from gymbridge.trainer.loop import LoopStep, train_step
from gymbridge.trainer.models import from_config, tiny_policy
from gymbridge.trainer.placement import GeneratorConfig
from gymbridge.trainer.ray_dp import DPWorker, RayDPTrainer, init_ray, param_digest, require_ray
from gymbridge.trainer.rundir import RunDir, step_record
from gymbridge.trainer.weight_sync import DistributedPublisher, InProcessPublisher, WeightPublisher

__all__ = [
    "DPWorker",
    "DistributedPublisher",
    "GRPOConfig",
    "GRPOTrainer",
    "GeneratorConfig",
    "GradientResult",
    "InProcessPublisher",
    "LoopStep",
    "RayDPTrainer",
    "RunDir",
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
    "step_record",
    "summarize",
    "tiny_policy",
    "token_logprobs",
    "train_step",
]
