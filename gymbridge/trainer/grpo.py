"""The GRPO step: :class:`GRPOConfig` (every variant), :class:`GRPOTrainer` (``prepare``,
``compute_gradients``, ``apply_gradients``, ``step``) and what a step reports (:class:`StepMetrics`).

The trainer is split one idea per module: the objective as pure functions
(:mod:`gymbridge.trainer.objective`: the clipped-ratio loss, KL estimators, aggregation), forward-input
assembly and teacher-forced logprobs (:mod:`gymbridge.trainer.forward`), the step (here), publication
(:mod:`gymbridge.trainer.weight_sync`) and checkpoints (:mod:`gymbridge.trainer.checkpoint`).

Invariants:

* gradients of a batch split into micro-batches or DP shards **sum** to the full-batch gradient:
  every part divides by the whole batch's normaliser (``total_loss_tokens`` / ``total_loss_rows``),
  and ``mask_truncated`` is applied before the split;
* the reference policy is never updated; the model runs in eval mode, so the ratio is 1 while the
  weights are the generator's;
* a batch with no loss token, or only zero advantages and no KL or entropy term, does not step
  the optimizer (``StepMetrics.skipped`` says why);
* the drift guard raises :class:`~gymbridge.errors.PolicyDriftError` on an on-policy step whose
  ``ratio_mean`` is off 1 by more than ``ratio_tolerance``, before the optimizer moves; rows sampled
  with another ``top_p`` raise :class:`~gymbridge.errors.SamplingMismatchError` before any forward.

The variants and their formulas (learning-rate schedule, loss aggregation, top-p, dual clip): docs/grpo.md;
off-policy correction (``is_cap``) and packing: docs/loop.md; the drift guard: docs/placement.md.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import time
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field, model_validator

from gymbridge.config import StrictModel
from gymbridge.errors import PolicyDriftError, SamplingMismatchError
from gymbridge.generation.lora import LoRAConfig, adapter_dropout, adapters_disabled, has_lora
from gymbridge.generation.types import GREEDY_BELOW_TEMPERATURE, is_greedy
from gymbridge.trainer.encoder import EncoderStats
from gymbridge.trainer.forward import media_kwargs, scored_logprobs, token_logprobs
from gymbridge.trainer.objective import (
    KLEstimator,
    LossAgg,
    aggregate_loss,
    grpo_token_loss,
    kl_estimate,
    loss_rows,
    nucleus_logprobs,
)
from gymbridge.trainer.packing import check_packable

if TYPE_CHECKING:
    from collections.abc import Callable

    from gymbridge.tensors import TrainBatch

logger = logging.getLogger(__name__)

__all__ = [
    "GRPOConfig",
    "GRPOTrainer",
    "GradientResult",
    "KLEstimator",
    "LRSchedule",
    "LossAgg",
    "SkipReason",
    "StepMetrics",
    "aggregate_loss",
    "check_sampling",
    "grpo_token_loss",
    "hit_token_limit",
    "kl_estimate",
    "loss_rows",
    "media_kwargs",
    "nucleus_logprobs",
    "skip_reason",
    "token_logprobs",
]

LRSchedule = Literal["constant", "linear", "cosine"]
SkipReason = Literal["no_loss_tokens", "zero_advantage"]


class GRPOConfig(StrictModel):
    """Trainer settings (YAML: the ``trainer:`` section of a run config, :class:`gymbridge.run.RunConfig`)."""

    lr: float = Field(1e-6, gt=0, le=1.0, allow_inf_nan=False)
    """AdamW learning rate: a finite number in (0, 1] (the peak of the schedule below). The default
    is for fine-tuning a pretrained model (TRL's and verl's GRPO examples use 1e-6); the tiny
    random-weight smoke model trains at 2e-3 (``gymbridge/configs/smoke.yaml``)."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Updates over which the learning rate rises linearly to ``lr`` (update ``k <= W`` uses
    ``lr * k / W``; docs/grpo.md). 0: none."""
    lr_schedule: LRSchedule = "constant"
    """After the warm-up: ``constant``, or a ``linear`` / ``cosine`` decay from ``lr`` to
    ``lr_min_ratio * lr`` at update ``lr_decay_steps``."""
    lr_decay_steps: int | None = Field(None, ge=1)
    """The update at which a decaying schedule reaches its floor (counted from the first update,
    warm-up included). ``None``: a run (:class:`gymbridge.run.RunConfig`) sets it to its ``steps``."""
    lr_min_ratio: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    """The decay's floor as a fraction of ``lr``."""
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = Field(1e-8, gt=0, le=1.0, allow_inf_nan=False)
    """AdamW's ``eps`` (added to the root of the second moment). Adam moves every weight by about
    ``lr`` whatever the size of its gradient, unless that gradient is well below ``adam_eps``: a
    larger one damps the weights that only ever see tiny gradients (docs/grpo.md, *Adam's eps*:
    the smoke configs' 1e-5)."""
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    max_grad_norm: float | None = 1.0
    temperature: float = Field(1.0, ge=GREEDY_BELOW_TEMPERATURE, allow_inf_nan=False)
    """The sampling temperature of the rollouts: new logprobs use the same scaled distribution. At
    least ``GREEDY_BELOW_TEMPERATURE`` (1e-5): below it sampling is greedy and logits divided by it
    overflow (a run refuses such a ``trainer.temperature`` before it starts)."""
    micro_batch_max_tokens: int = Field(8192, ge=1)
    """Tokens per forward pass: padded tokens (rows x longest row), or with ``sequence_packing`` the
    real tokens of the packed sequence. A longer row runs alone in a micro-batch of its own."""
    sequence_packing: bool = False
    """Run each micro-batch's rows as one packed sequence (block-diagonal causal mask, the model's
    own M-RoPE positions per row: :mod:`gymbridge.trainer.packing`) instead of padded rows."""
    suppress_token_ids: tuple[int, ...] | None = None
    """Token ids the generator never samples (logits -inf): new logprobs renormalise without them.
    ``None``: the policy's media placeholder / vision boundary ids (what ``HFGenerator`` masks);
    ``[]``: no mask."""
    ratio_tolerance: float | None = Field(1e-2, gt=0)
    """On-policy drift guard: the step fails when ``|ratio_mean - 1|`` exceeds this (``None``: off)."""
    is_cap: float | None = None
    """Truncated importance weight cap ``C`` (docs/loop.md; V-trace's ``rho_bar``): the unclipped
    surrogate term uses ``min(ratio, C)``. ``None``: off. Must be ``>= 1 + clip_eps_high``."""
    clip_ratio_c: float | None = Field(None, gt=1.0, allow_inf_nan=False)
    """Dual clip ``c`` (verl's ``clip_ratio_c``, Ye et al. 2020, arXiv:1912.09729): for a negative
    advantage the per-token loss stops at ``c * |A|`` once the ratio passes ``c`` (no gradient beyond;
    docs/grpo.md, *Dual clip*). ``None``: off. Must be > 1."""
    encoder_dedup: bool = True
    """Run the media encoders once per unique item of a micro-batch and scatter their outputs to every
    reference (:mod:`gymbridge.trainer.encoder`; same loss and gradients as encoding every copy). A model
    without the hook falls back to the materialised path (logged; ``StepMetrics.encoder_dedup`` False)."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """The policy's compute dtype. ``bfloat16`` in a run without DP workers: the trainer keeps fp32
    master weights and AdamW state and runs its forward and backward passes under bf16 autocast; the
    KL reference and the in-process generator hold bf16 weights (docs/memory.md). With DP workers
    the driver's policy is cast to it and the workers keep their own precision (docs/dp.md).
    Floating media bound for the policy are cast to it before they cross to DP workers
    (:meth:`~gymbridge.tensors.TrainBatch.cast_media`)."""
    activation_checkpointing: bool = False
    """Keep only each block's inputs (decoder layers, encoder layers) through the forward and run
    the block again in the backward (:func:`gymbridge.trainer.memory.apply_activation_checkpointing`):
    the same gradients, less memory, about one more forward of time (docs/memory.md)."""
    freeze_vision_tower: bool = False
    """Train without the vision and audio encoders: their parameters get ``requires_grad=False``
    (:func:`gymbridge.trainer.memory.freeze_encoders`); a model without one is refused."""
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    """LoRA adapters on the language model instead of full fine-tuning (``rank: 0``, the default:
    off): :mod:`gymbridge.trainer.lora`, docs/run.md (*LoRA*). With LoRA the KL reference is the
    base model (the adapters switched off) and only the adapters are published and checkpointed."""

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a ``torch.dtype``."""
        return torch.bfloat16 if self.dtype == "bfloat16" else torch.float32

    top_p: float = Field(1.0, gt=0, le=1.0, allow_inf_nan=False)
    """The rollouts' nucleus (top-p) sampling: new logprobs are renormalised over the same nucleus
    (docs/grpo.md, *Top-p*). Rows recording another ``top_p`` fail the step."""
    kl_coef: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Weight ``beta`` of the KL penalty to a frozen copy of the initial policy (0: none, no copy)."""
    kl_estimator: KLEstimator = "k3"
    """``k1``: ``new - ref``; ``k3``: ``exp(ref - new) - (ref - new) - 1``; ``low_var_kl``: k3 with
    its value clamped to ``[-10, 10]`` as verl's (:mod:`gymbridge.trainer.objective`)."""
    kl_bias_correction: bool = False
    """Multiply the per-token KL term by the importance ratio ``exp(new - old)`` (differentiable), as
    TRL's ``use_bias_correction_kl``: the KL term's gradient becomes that of ``KL(pi_theta || pi_ref)``
    under the behaviour policy's samples (docs/grpo.md). Only with ``kl_coef > 0``."""
    entropy_coef: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Weight of an entropy bonus (verl's ``entropy_coeff``): the per-token loss gets
    ``- entropy_coef * H_t``, ``H_t`` the entropy of the policy's next-token distribution at loss
    token ``t`` (temperature-scaled, without the suppressed tokens, over the whole vocabulary
    even with ``top_p < 1``), aggregated as the rest of the loss: a push against collapsing onto
    one answer, spread over every token of the vocabulary (docs/grpo.md, *Entropy bonus*, has what
    it did on the spatial task). 0: none (not computed)."""
    loss_agg: LossAgg = "token_mean"
    """How per-token losses become the batch loss (docs/grpo.md, *Loss aggregation*)."""
    mask_truncated: bool = False
    """Zero the loss mask of rollouts that hit the token limit (``max_output_tokens``)."""

    @model_validator(mode="after")
    def _decay_has_a_horizon(self) -> GRPOConfig:
        if self.lr_schedule != "constant" and self.lr_decay_steps is None:
            raise ValueError(
                f"lr_schedule={self.lr_schedule!r} needs lr_decay_steps >= 1: the update at which the "
                "decay reaches lr_min_ratio * lr (a run sets it to its steps)"
            )
        return self

    def lr_at(self, update: int) -> float:
        """The learning rate of optimizer update ``update`` (1 for the first; docs/grpo.md)."""
        if update < 1:
            raise ValueError(f"updates are counted from 1, got {update}")
        warm = self.lr_warmup_steps
        if update <= warm:
            return self.lr * update / warm
        if self.lr_schedule == "constant":
            return self.lr
        span = (self.lr_decay_steps or warm) - warm
        progress = min(1.0, (update - warm) / span) if span > 0 else 1.0
        shape = 1.0 - progress if self.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr * (self.lr_min_ratio + (1.0 - self.lr_min_ratio) * shape)

    @property
    def lr_scheduled(self) -> bool:
        """Whether the learning rate changes over updates (a warm-up or a decay)."""
        return self.lr_warmup_steps > 0 or self.lr_schedule != "constant"

    @model_validator(mode="after")
    def _one_rule_for_the_tower(self) -> GRPOConfig:
        if self.lora.enabled and self.lora.vision == "full" and self.freeze_vision_tower:
            raise ValueError(
                "trainer.lora.vision=full trains the vision tower, trainer.freeze_vision_tower=true freezes "
                "it: set one of them"
            )
        return self

    @model_validator(mode="after")
    def _cap_above_clip(self) -> GRPOConfig:
        if self.is_cap is not None and self.is_cap < 1.0 + self.clip_eps_high:
            raise ValueError(
                f"is_cap ({self.is_cap}) must be >= 1 + clip_eps_high ({1.0 + self.clip_eps_high}): "
                "a lower cap would change tokens the ratio clip already bounds"
            )
        return self


@dataclass(frozen=True)
class StepMetrics:
    """What one step reports (``loss``: the aggregated loss, PG plus KL term, before the update)."""

    loss: float
    mean_reward: float
    mean_advantage_abs: float
    num_rows: int
    num_tokens: int
    num_loss_tokens: int
    grad_norm: float
    clip_fraction: float
    mean_ratio: float
    approx_kl: float
    """Mean of ``old - new`` logprob over loss tokens (k1 estimator of KL(old || new))."""
    elapsed_s: float = 0.0
    ratio_mean: float = 1.0
    """Mean importance ratio over the loss tokens of the first micro-batch, before any update."""
    ratio_max_abs_log: float = 0.0
    """Largest ``|new - old|`` logprob over those tokens."""
    policy_version: int | None = None
    """The policy version published after this step (optimizer steps so far); set by the run."""
    weight_sync_s: float = 0.0
    """Seconds spent publishing this step's weights to the generator; set by the run."""
    weight_sync_bytes: int = 0
    """Bytes of tensors this step's publication sent (with LoRA: the adapters only); set by the run."""
    is_capped_fraction: float = 0.0
    """Loss tokens whose importance weight ``GRPOConfig.is_cap`` truncated, over all loss tokens."""
    packed_sequences: int = 0
    """Packed sequences the forward passes ran (one per micro-batch with ``sequence_packing``; else 0)."""
    padding_fraction: float = 0.0
    """Padding tokens over all tokens the forward passes ran (0 when packed)."""
    encoder_segments: int = 0
    """Media items the encoders ran on this step, summed over micro-batches (with ``encoder_dedup``:
    each unique item once per micro-batch holding it; otherwise every reference)."""
    encoder_refs: int = 0
    """Media references (placeholder blocks) the encoder outputs filled this step, every copy counted."""
    encoder_dedup: bool = False
    """Every micro-batch with media encoded each unique item once (False without media)."""
    kl: float = 0.0
    """Token mean over loss tokens of the KL estimator to the reference (0.0 when ``kl_coef == 0``)."""
    truncated_masked: int = 0
    """Rows whose loss tokens ``mask_truncated`` removed (their rollout hit the token limit)."""
    top_p_outside_fraction: float = 0.0
    """Loss tokens outside the trainer's top-p nucleus (kept with their own mass, docs/grpo.md)."""
    lr: float = 0.0
    """The learning rate of this step's update (``GRPOConfig.lr_at``); 0.0 when no update ran."""
    skipped: SkipReason | None = None
    """Why the optimizer was not stepped (:func:`skip_reason`); ``None``: it was."""
    forward_backward_s: float = 0.0
    """Seconds of this step's forward and backward passes (every micro-batch, the reference's
    forward included); with data parallelism, the slowest part's."""
    optimizer_s: float = 0.0
    """Seconds of the update itself: gradient clipping and the optimizer step (0.0 when skipped)."""
    dual_clip_fraction: float = 0.0
    """Loss tokens whose loss the dual clip (``GRPOConfig.clip_ratio_c``) stopped at ``c * |A|``,
    over all loss tokens (0.0 with it off)."""
    entropy: float | None = None
    """Token mean over loss tokens of the policy's next-token entropy (nats, before the update);
    ``None`` when ``entropy_coef == 0`` (not computed)."""

    def as_dict(self) -> dict[str, float | int | None]:
        return asdict(self)


@dataclass(frozen=True)
class GradientResult:
    """Gradients of one batch part (one tensor per trainable parameter, in ``parameters()`` order)."""

    grads: list[torch.Tensor]
    loss_sum: float
    """This part's share of the batch loss (per-token losses over the whole batch's normaliser)."""
    loss_tokens: int
    clipped_tokens: int
    ratio_sum: float
    kl_sum: float
    first_ratio_mean: float = 1.0
    """Mean ratio over the loss tokens of this part's first micro-batch (before any update)."""
    first_max_abs_log: float = 0.0
    """Largest ``|new - old|`` logprob over those tokens."""
    capped_tokens: int = 0
    """Tokens whose importance weight ``is_cap`` truncated."""
    tokens_run: int = 0
    """Tokens the forward passes computed (padding included)."""
    padding_tokens: int = 0
    """Of those, padding."""
    packed_sequences: int = 0
    """Packed sequences run (``sequence_packing``)."""
    encoder_segments: int = 0
    """Media items encoded over this part's micro-batches (see ``StepMetrics.encoder_segments``)."""
    encoder_refs: int = 0
    encoder_dedup: bool = False
    """Every micro-batch of this part with media encoded once per unique item."""
    ref_kl_sum: float = 0.0
    """Sum over this part's loss tokens of the KL estimator to the reference."""
    outside_top_p_tokens: int = 0
    """Loss tokens outside the trainer's top-p nucleus."""
    forward_backward_s: float = 0.0
    """Seconds this part's forward and backward passes took."""
    dual_clipped_tokens: int = 0
    """Loss tokens whose loss the dual clip (``clip_ratio_c``) stopped at ``c * |A|``."""
    entropy_sum: float | None = None
    """Sum over this part's loss tokens of the policy's entropy (``None``: not computed)."""


def hit_token_limit(meta: dict[str, Any]) -> bool:
    """Whether a row's rollout stopped at the token limit (``incomplete_details.reason``)."""
    return meta.get("incomplete_reason") == "max_output_tokens"


def check_sampling(batch: TrainBatch, top_p: float, temperature: float | None = None) -> None:
    """Refuse rows sampled otherwise than the trainer scores them (:class:`SamplingMismatchError`).

    A row says how it was sampled in ``metadata["sampling"]`` (``temperature``, ``top_p``; see
    :func:`~gymbridge.trajectory.from_gym_result`); rows that say nothing are not checked. A row's
    ``top_p`` must be the trainer's (a greedy row, ``temperature`` 0 or below
    ``GREEDY_BELOW_TEMPERATURE``, counts as ``top_p = 1``),
    and with ``temperature`` given, so must its temperature: the ratio of logprobs of two
    differently scaled distributions is biased whatever the staleness, so a mismatch is refused
    on-policy and off-policy alike.
    """
    for row, meta in enumerate(batch.metadata):
        sampling = meta.get("sampling")
        if not isinstance(sampling, dict):
            continue
        row_temperature = _number(sampling.get("temperature"))
        if row_temperature is not None and is_greedy(row_temperature):
            row_temperature = 0.0  # 1e-40 was sampled greedily (SamplingConfig stores it as 0)
        row_top_p = _number(sampling.get("top_p"))
        if row_temperature == 0:  # greedy: raw logprobs, no nucleus
            row_top_p = 1.0 if row_top_p is not None else None
        for setting, asked, trainer_value in (
            ("temperature", row_temperature, temperature),
            ("top_p", row_top_p, top_p),
        ):
            if asked is None or trainer_value is None:
                continue
            if not math.isclose(asked, trainer_value, rel_tol=1e-6, abs_tol=1e-9):
                raise SamplingMismatchError(
                    setting=setting,
                    rollout_value=asked,
                    trainer_value=trainer_value,
                    row=row,
                    task_index=meta.get("task_index"),
                    rollout_index=meta.get("rollout_index"),
                )


def _number(value: Any) -> float | None:
    """``value`` as a float when it is a number (not a bool), else ``None``."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def skip_reason(batch: TrainBatch, config: GRPOConfig) -> SkipReason | None:
    """Why an update on ``batch`` would change nothing it should, or ``None`` when it trains.

    ``no_loss_tokens``: every row is masked or empty. ``zero_advantage``: every loss row's advantage
    is exactly 0 (every group's rewards were equal) and there is no KL or entropy term, so the loss
    gradient is exactly 0. Either way the optimizer must not step: AdamW's momentum and weight decay
    would still move the weights, the policy version would advance and the generator would get the
    same weights again. With ``kl_coef > 0`` or ``entropy_coef > 0`` a zero-advantage batch still trains (the
    KL term and the entropy bonus have a gradient).
    """
    has_loss = batch.loss_mask.sum(dim=1) > 0
    if len(batch) == 0 or not bool(has_loss.any()):
        return "no_loss_tokens"
    if config.kl_coef == 0 and config.entropy_coef == 0 and not bool((batch.advantages[has_loss] != 0).any()):
        return "zero_advantage"
    return None


class GRPOTrainer:
    """Owns a policy model and its optimizer (AdamW); :meth:`step` runs one GRPO update."""

    def __init__(
        self,
        model: Any,
        config: GRPOConfig | None = None,
        *,
        optimizer: Any | None = None,
        on_policy: bool = True,
        reference: Any | None = None,
    ) -> None:
        """``on_policy``: rollouts come from the current weights (``max_staleness == 0``): guard the ratio.

        ``reference``: a ready frozen reference policy (an FSDP worker's sharded one) instead of a
        copy of ``model`` (``kl_coef > 0`` only)."""
        self.model = model
        self.config = config or GRPOConfig()
        self.on_policy = on_policy
        if self.config.sequence_packing:
            check_packable(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = optimizer or torch.optim.AdamW(
            self.params,
            lr=self.config.lr,
            betas=self.config.betas,
            eps=self.config.adam_eps,
            weight_decay=self.config.weight_decay,
        )
        self.steps = 0
        self.reference: Any | None = reference
        """The frozen reference policy (``kl_coef > 0``; ``None`` otherwise)."""
        self.lora = has_lora(model)
        """The policy holds LoRA adapters (:func:`gymbridge.trainer.lora.apply_lora`): with ``kl_coef > 0``
        the reference is the same model with its adapters off, no copy."""
        if self.config.kl_coef > 0 and reference is None:
            self.freeze_reference()

    @property
    def kl_reference(self) -> str | None:
        """Where the KL reference comes from: ``"base_adapters_off"`` (LoRA), ``"copy"`` (a frozen
        copy here), ``"sharded"`` (FSDP workers hold it) or ``None`` (``kl_coef == 0``)."""
        if self.config.kl_coef <= 0:
            return None
        if self.lora:
            return "base_adapters_off"
        return "copy" if self.reference is not None else "sharded"

    def freeze_reference(self) -> None:
        """Take (or re-take) the reference policy: a frozen copy of the policy's current weights.

        The reference is always held in the trainer's dtype (``GRPOConfig.dtype``), whatever the
        policy's dtype when it is taken (a run freezes it after its fp32 warm-up, before the cast),
        so a fresh run, a resumed one and every DP worker score the KL against the same numbers.
        A LoRA policy keeps no copy: its reference is its base model (adapters off), already frozen.
        """
        if self.config.kl_coef <= 0:
            raise ValueError("freeze_reference: kl_coef is 0, the trainer keeps no reference policy")
        if self.lora:
            self.reference = None
            return
        ref = copy.deepcopy(self.model).to(self.config.torch_dtype)
        ref.eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        self.reference = ref

    def prepare(self, batch: TrainBatch) -> tuple[TrainBatch, int]:
        """The whole batch as the loss sees it, before any split: ``(batch, truncated rows masked)``.

        Checks the rows' sampling against ``top_p`` and ``temperature`` (:func:`check_sampling`) and, with
        ``mask_truncated``, zeroes the loss mask of rows that hit the token limit.
        """
        check_sampling(batch, self.config.top_p, self.config.temperature)
        if not self.config.mask_truncated or len(batch) == 0:
            return batch, 0
        hit = torch.tensor([hit_token_limit(m) for m in batch.metadata], dtype=torch.bool)
        counted = hit & (batch.loss_mask.sum(dim=1) > 0)
        masked = int(counted.sum())
        if not masked:
            return batch, 0
        keep = (~hit).to(batch.loss_mask.dtype)[:, None]
        return replace(batch, loss_mask=batch.loss_mask * keep), masked

    def compute_gradients(
        self,
        batch: TrainBatch,
        *,
        total_loss_tokens: int | None = None,
        total_loss_rows: int | None = None,
        accumulate: Literal["grad", "backward"] = "grad",
        schedule: Callable[[list[TrainBatch]], list[tuple[TrainBatch, bool]]] | None = None,
    ) -> GradientResult:
        """Gradients of ``batch``'s loss (micro-batched by token budget); the model is not updated.

        ``total_loss_tokens`` / ``total_loss_rows`` are the loss-token count and the count of
        rows holding a loss token of the whole batch this one is part of (default: this batch's
        own), so gradients of parts add up to the whole's. ``batch`` is used as given:
        :meth:`step` calls :meth:`prepare` on the whole batch first.

        ``accumulate="grad"``: the gradients are returned (``GradientResult.grads``, one per
        parameter); ``"backward"``: ``loss.backward()`` per micro-batch leaves them summed in each
        parameter's ``.grad`` (what FSDP reduces during the backward) and ``grads`` is empty.
        ``schedule`` maps every micro-batch of ``batch`` to the passes to run, each ``(micro_batch,
        counted)``; an uncounted pass runs forward and backward with its loss times 0 and adds to no
        metric (FSDP ranks must run the same passes). Default: every micro-batch holding a loss token.
        """
        started = time.perf_counter()
        cfg = self.config
        total = int(batch.loss_mask.sum()) if total_loss_tokens is None else int(total_loss_tokens)
        rows = loss_rows(batch.loss_mask) if total_loss_rows is None else int(total_loss_rows)
        backward = accumulate == "backward"
        grads = [] if backward else [torch.zeros_like(p) for p in self.params]
        result = GradientResult(grads, 0.0, int(batch.loss_mask.sum()), 0, 0.0, 0.0)
        packed = cfg.sequence_packing
        if schedule is None:
            if len(batch) == 0 or result.loss_tokens == 0:
                return result
            mbs = batch.micro_batches(cfg.micro_batch_max_tokens, packed=packed)
            passes = [(mb, True) for mb in mbs if float(mb.loss_mask.sum()) > 0]
        else:
            mbs = batch.micro_batches(cfg.micro_batch_max_tokens, packed=packed) if len(batch) else []
            passes = schedule(mbs)
        if not passes:
            return result
        lead = next((mb for mb in mbs if float(mb.loss_mask.sum()) > 0), None)
        self.model.eval()
        if self.lora and cfg.lora.dropout > 0:
            adapter_dropout(self.model, True)  # only the adapters' dropout: the base stays in eval mode
        loss_sum = ratio_sum = kl_sum = ref_kl_sum = entropy_sum = 0.0
        clipped = capped = dual = outside = tokens_run = padding = sequences = 0
        first: tuple[float, float] | None = None
        encoder = EncoderStats()
        for mb, counted in passes:
            score = functools.partial(
                scored_logprobs,
                batch=mb,
                temperature=cfg.temperature,
                suppress_token_ids=cfg.suppress_token_ids,
                top_p=cfg.top_p,
                packed=packed,
                encoder_dedup=cfg.encoder_dedup,
            )
            new_lp, mb_outside, mb_entropy = score(
                self.model, encoder_stats=encoder if counted else None, entropy=cfg.entropy_coef > 0
            )
            ref_lp: torch.Tensor | None = None
            if self.reference is not None:
                with torch.no_grad():
                    ref_lp, _, _ = score(self.reference)
            elif self.lora and cfg.kl_coef > 0:
                with torch.no_grad(), adapters_disabled(self.model):
                    ref_lp, _, _ = score(self.model)
            run = mb.num_tokens if packed else len(mb) * mb.seq_len
            padding += run - mb.num_tokens
            sequences += int(packed)
            loss, stats = grpo_token_loss(
                new_lp,
                mb.logprobs,
                mb.advantages,
                mb.loss_mask,
                clip_eps_low=cfg.clip_eps_low,
                clip_eps_high=cfg.clip_eps_high,
                total_loss_tokens=total,
                is_cap=cfg.is_cap,
                loss_agg=cfg.loss_agg,
                total_loss_rows=rows,
                ref_logprobs=ref_lp,
                kl_coef=cfg.kl_coef,
                kl_estimator=cfg.kl_estimator,
                clip_ratio_c=cfg.clip_ratio_c,
                kl_bias_correction=cfg.kl_bias_correction,
                entropy=mb_entropy,
                entropy_coef=cfg.entropy_coef,
            )
            if not counted:  # a lockstep pass: the same collectives, no gradient, no metric
                torch.autograd.backward(loss * 0.0)
                continue
            tokens_run += run
            if backward:
                torch.autograd.backward(loss)
            else:
                part = torch.autograd.grad(loss, self.params, allow_unused=True)
                for acc, g in zip(grads, part, strict=True):
                    if g is not None:
                        acc.add_(g)
            if mb is lead:
                first = (stats["ratio_sum"] / float(mb.loss_mask.sum()), stats["max_abs_log"])
            loss_sum += float(loss.detach())
            clipped += int(stats["clipped"])
            capped += int(stats["capped"])
            dual += int(stats["dual_clipped"])
            outside += mb_outside
            ratio_sum += stats["ratio_sum"]
            kl_sum += stats["kl_sum"]
            ref_kl_sum += stats["ref_kl_sum"]
            entropy_sum += stats["entropy_sum"]
        first_mean, first_max = first if first is not None else (1.0, 0.0)
        return GradientResult(
            grads,
            loss_sum,
            result.loss_tokens,
            clipped,
            ratio_sum,
            kl_sum,
            first_ratio_mean=first_mean,
            first_max_abs_log=first_max,
            capped_tokens=capped,
            dual_clipped_tokens=dual,
            tokens_run=tokens_run,
            padding_tokens=padding,
            packed_sequences=sequences,
            encoder_segments=encoder.segments,
            encoder_refs=encoder.refs,
            encoder_dedup=encoder.deduplicated,
            ref_kl_sum=ref_kl_sum,
            entropy_sum=entropy_sum if cfg.entropy_coef > 0 else None,
            outside_top_p_tokens=outside,
            forward_backward_s=time.perf_counter() - started,
        )

    def check_drift(self, first: GradientResult) -> None:
        """The drift guard (module docstring) on a step's first part; raises before any update."""
        tol = self.config.ratio_tolerance
        if not self.on_policy or tol is None or first.loss_tokens == 0:
            return
        if not abs(first.first_ratio_mean - 1.0) <= tol:  # NaN fails too
            raise PolicyDriftError(
                ratio_mean=first.first_ratio_mean,
                ratio_max_abs_log=first.first_max_abs_log,
                tolerance=tol,
                step=self.steps + 1,
            )

    def apply_gradients(self, grads: list[torch.Tensor] | None) -> float:
        """Set ``grads``, clip them to ``max_grad_norm`` (in place), step; returns the pre-clip norm.

        ``None``: the gradients are already in each parameter's ``.grad`` (``accumulate="backward"``;
        FSDP's sharded ``DTensor`` gradients: the norm is the global one over every rank's shards).
        """
        if grads is not None:
            for p, g in zip(self.params, grads, strict=True):
                p.grad = g.to(device=p.device, dtype=p.dtype)
        with_grad = [p for p in self.params if p.grad is not None]
        if self.config.max_grad_norm is not None:
            total = torch.nn.utils.clip_grad_norm_(with_grad, self.config.max_grad_norm)
        else:
            total = torch.nn.utils.get_total_norm([p.grad for p in with_grad if p.grad is not None])
        full = getattr(total, "full_tensor", None)  # a DTensor norm: every rank's shards reduced
        norm = float(full() if full is not None else total)
        if grads is not None:
            for g, p in zip(grads, self.params, strict=True):
                assert p.grad is not None
                g.copy_(p.grad)  # callers (DP workers) apply exactly the clipped gradients
        if self.config.lr_scheduled:  # a function of the update count: a resumed run continues it
            for group in self.optimizer.param_groups:
                group["lr"] = self.config.lr_at(self.steps + 1)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return norm

    def step(self, batch: TrainBatch) -> StepMetrics:
        """One GRPO update on ``batch``; returns its metrics."""
        started = time.perf_counter()
        batch, truncated = self.prepare(batch)
        skipped = skip_reason(batch, self.config)
        if skipped is not None:
            log_skipped_step(batch, skipped)
            return summarize(
                batch, [], 0.0, time.perf_counter() - started, truncated_masked=truncated, skipped=skipped
            )
        res = self.compute_gradients(batch)
        self.check_drift(res)
        lr = self.config.lr_at(self.steps + 1)
        updating = time.perf_counter()
        norm = self.apply_gradients(res.grads)
        optimizer_s = time.perf_counter() - updating
        return summarize(
            batch,
            [res],
            norm,
            time.perf_counter() - started,
            truncated_masked=truncated,
            lr=lr,
            optimizer_s=optimizer_s,
        )


def log_skipped_step(batch: TrainBatch, reason: SkipReason) -> None:
    """Say that the update on ``batch`` is skipped (optimizer untouched) and why (:func:`skip_reason`).

    At DEBUG: ``StepMetrics.skipped`` carries the reason and the run's step line says ``skipped``,
    so at INFO this line only interleaved with the step lines of every run.
    """
    why = (
        "has no loss token (every row masked or empty)"
        if reason == "no_loss_tokens"
        else "has zero advantage on every row (each group's rewards were all equal)"
    )
    logger.debug(
        "GRPO step skipped: the batch of %d row(s) %s; the optimizer is not stepped, so momentum and "
        "weight decay do not move the weights",
        len(batch),
        why,
    )


def summarize(
    batch: TrainBatch,
    parts: list[GradientResult],
    grad_norm: float,
    elapsed_s: float,
    *,
    truncated_masked: int = 0,
    lr: float = 0.0,
    skipped: SkipReason | None = None,
    optimizer_s: float = 0.0,
) -> StepMetrics:
    """Step metrics from the gradient results of a batch's parts (``lr``: the update's learning rate,
    ``optimizer_s``: the seconds ``apply_gradients`` took; parts run side by side, so the step's
    forward/backward seconds are the slowest part's).

    A skipped step (no parts) still counts the batch's loss tokens; its ratios are 1 (nothing moved)."""
    tokens = sum(p.loss_tokens for p in parts) if parts else int(batch.loss_mask.sum())
    rows = batch.sample_mask.bool()
    # one reward per trajectory (a split trajectory has several rows sharing it)
    # the drift numbers: the first part holding a loss token (its first micro-batch)
    lead = next((p for p in parts if p.loss_tokens), None)
    traj_rewards: dict[int, float] = {}
    for sid, r, keep in zip(batch.sample_ids.tolist(), batch.rewards.tolist(), rows.tolist(), strict=True):
        if keep:
            traj_rewards[int(sid)] = float(r)
    return StepMetrics(
        loss=sum(p.loss_sum for p in parts),
        mean_reward=sum(traj_rewards.values()) / len(traj_rewards) if traj_rewards else float("nan"),
        mean_advantage_abs=float(batch.advantages[rows].abs().mean()) if bool(rows.any()) else 0.0,
        num_rows=len(batch),
        num_tokens=batch.num_tokens,
        num_loss_tokens=tokens,
        grad_norm=grad_norm,
        clip_fraction=sum(p.clipped_tokens for p in parts) / max(tokens, 1),
        mean_ratio=sum(p.ratio_sum for p in parts) / max(tokens, 1) if parts else 1.0,
        approx_kl=sum(p.kl_sum for p in parts) / max(tokens, 1),
        elapsed_s=elapsed_s,
        ratio_mean=lead.first_ratio_mean if lead is not None else 1.0,
        ratio_max_abs_log=lead.first_max_abs_log if lead is not None else 0.0,
        is_capped_fraction=sum(p.capped_tokens for p in parts) / max(tokens, 1),
        packed_sequences=sum(p.packed_sequences for p in parts),
        padding_fraction=sum(p.padding_tokens for p in parts) / max(sum(p.tokens_run for p in parts), 1),
        encoder_segments=sum(p.encoder_segments for p in parts),
        encoder_refs=sum(p.encoder_refs for p in parts),
        encoder_dedup=any(p.encoder_refs for p in parts)
        and all(p.encoder_dedup for p in parts if p.encoder_refs),
        kl=sum(p.ref_kl_sum for p in parts) / max(tokens, 1),
        truncated_masked=truncated_masked,
        top_p_outside_fraction=sum(p.outside_top_p_tokens for p in parts) / max(tokens, 1),
        lr=lr,
        skipped=skipped,
        forward_backward_s=max((p.forward_backward_s for p in parts), default=0.0),
        optimizer_s=optimizer_s,
        dual_clip_fraction=sum(p.dual_clipped_tokens for p in parts) / max(tokens, 1),
        entropy=(
            sum(p.entropy_sum or 0.0 for p in parts) / max(tokens, 1)
            if any(p.entropy_sum is not None for p in parts)
            else None
        ),
    )
