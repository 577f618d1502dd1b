"""A reference GRPO step: teacher-forced logprobs, clipped-ratio policy gradient, one optimizer step.

A :class:`~gymbridge.tensors.TrainBatch` has ``B`` rows of ``L`` tokens. For row ``b`` and position
``t >= 1`` the new logprob is ``log_softmax(logits[b, t-1] / T)[ids[b, t]]`` (``T`` the rollouts'
temperature; over the rollouts' top-p nucleus and without the suppressed media tokens, as the
generator sampled); the old one is ``batch.logprobs[b, t]``, the generator's. With ``ratio = exp(new
- old)`` and the row's advantage ``A`` the per-token loss is ``-min(ratio * A, clip(ratio, 1 -
eps_low, 1 + eps_high) * A)``, plus ``kl_coef * KL_t`` to a frozen reference, minus
``entropy_coef * H_t`` (the policy's entropy at that token), under the batch's ``loss_mask``.
Public pieces: :class:`GRPOConfig` (every variant: lr schedule, KL, entropy bonus, dual clip,
``is_cap``, loss aggregation, top-p, ``mask_truncated``, packing), :class:`GRPOTrainer`
(``prepare``, ``compute_gradients``, ``step``), :class:`StepMetrics`, :func:`token_logprobs`,
:func:`skip_reason`.

Invariants:

* gradients of a batch split into micro-batches or DP shards **sum** to the full-batch gradient:
  every part divides by the whole batch's normaliser (``total_loss_tokens`` / ``total_loss_rows``),
  and ``mask_truncated`` is applied before the split;
* media reach the model only here, per micro-batch, right before the forward pass (encoded once per
  unique item, :mod:`gymbridge.trainer.encoder`, or materialized), under the names its ``forward``
  takes; no media key ever replaces the text ``input_ids`` / ``attention_mask``;
* the reference policy is never updated; the model runs in eval mode, so the ratio is 1 while the
  weights are the generator's;
* a batch with no loss token, or only zero advantages and no KL or entropy term, does not step
  the optimizer (``StepMetrics.skipped`` says why);
* the drift guard raises :class:`~gymbridge.errors.PolicyDriftError` on an on-policy step whose
  ``ratio_mean`` is off 1 by more than ``ratio_tolerance``, before the optimizer moves; rows sampled
  with another ``top_p`` raise :class:`~gymbridge.errors.SamplingMismatchError` before any forward.

The variants and their formulas: docs/grpo.md; off-policy correction (``is_cap``) and packing:
docs/loop.md; the drift guard: docs/placement.md; suppressed media tokens: docs/generation.md.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field, model_validator

from gymbridge.config import StrictModel
from gymbridge.errors import PolicyDriftError, SamplingMismatchError, TrajectoryError
from gymbridge.generation.types import GREEDY_BELOW_TEMPERATURE, is_greedy, media_special_token_ids
from gymbridge.trainer.encoder import (
    EncoderStats,
    encode_unique,
    encoder_plan,
    encoder_refs,
    log_fallback_once,
)
from gymbridge.trainer.packing import PackedRows, check_packable, packed_forward_kwargs

if TYPE_CHECKING:
    from gymbridge.families import ModelFamily
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


LossAgg = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"]
LRSchedule = Literal["constant", "linear", "cosine"]
KLEstimator = Literal["k1", "k3", "low_var_kl"]
SkipReason = Literal["no_loss_tokens", "zero_advantage"]
KL_LOG_RATIO_CLAMP = 20.0
"""``|ref - new|`` bound inside the k3 estimator (``exp(20)`` ~ 5e8: large, never infinite)."""
LOW_VAR_KL_CLAMP = 10.0
"""``low_var_kl``: k3's value is clamped to ``[-10, 10]`` (verl's ``low_var_kl``; k3 >= 0, so only
the upper bound acts: tokens with ``ref - new > 2.61`` or ``new - ref > 11.0``, module docstring)."""


class GRPOConfig(StrictModel):
    """Trainer settings (YAML: the ``trainer:`` section of a run config, :class:`gymbridge.run.RunConfig`)."""

    lr: float = Field(1e-6, gt=0, le=1.0, allow_inf_nan=False)
    """AdamW learning rate: a finite number in (0, 1] (the peak of the schedule below). The default
    is for fine-tuning a pretrained model (TRL's and verl's GRPO examples use 1e-6); the tiny
    random-weight smoke model trains at 2e-3 (``gymbridge/configs/smoke.yaml``)."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Updates over which the learning rate rises linearly to ``lr`` (update ``k <= W`` uses
    ``lr * k / W``; module docstring, *Learning-rate schedule*). 0: none."""
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
    """Truncated importance weight cap ``C`` (module docstring; V-trace's ``rho_bar``): the unclipped
    surrogate term uses ``min(ratio, C)``. ``None``: off. Must be ``>= 1 + clip_eps_high``."""
    clip_ratio_c: float | None = Field(None, gt=1.0, allow_inf_nan=False)
    """Dual clip ``c`` (verl's ``clip_ratio_c``, Ye et al. 2020, arXiv:1912.09729): for a negative
    advantage the per-token loss stops at ``c * |A|`` once the ratio passes ``c`` (no gradient beyond;
    module docstring, *Dual clip*). ``None``: off. Must be > 1."""
    encoder_dedup: bool = True
    """Run the media encoders once per unique item of a micro-batch and scatter their outputs to every
    reference (:mod:`gymbridge.trainer.encoder`; same loss and gradients as encoding every copy). A model
    without the hook falls back to the materialised path (logged; ``StepMetrics.encoder_dedup`` False)."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """The policy's dtype for training (a run builds the trainer's and the in-process
    generator's models in it); floating media bound for the policy are cast to it before they
    cross to DP workers (:meth:`~gymbridge.tensors.TrainBatch.cast_media`)."""

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a ``torch.dtype``."""
        return torch.bfloat16 if self.dtype == "bfloat16" else torch.float32

    top_p: float = Field(1.0, gt=0, le=1.0, allow_inf_nan=False)
    """The rollouts' nucleus (top-p) sampling: new logprobs are renormalised over the same nucleus
    (module docstring, *Top-p*). Rows recording another ``top_p`` fail the step."""
    kl_coef: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Weight ``beta`` of the KL penalty to a frozen copy of the initial policy (0: none, no copy)."""
    kl_estimator: KLEstimator = "k3"
    """``k1``: ``new - ref``; ``k3``: ``exp(ref - new) - (ref - new) - 1``; ``low_var_kl``: k3 with
    its value clamped to ``[-10, 10]`` as verl's (module docstring)."""
    kl_bias_correction: bool = False
    """Multiply the per-token KL term by the importance ratio ``exp(new - old)`` (differentiable), as
    TRL's ``use_bias_correction_kl``: the KL term's gradient becomes that of ``KL(pi_theta || pi_ref)``
    under the behaviour policy's samples (module docstring). Only with ``kl_coef > 0``."""
    entropy_coef: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Weight of an entropy bonus (verl's ``entropy_coeff``): the per-token loss gets
    ``- entropy_coef * H_t``, ``H_t`` the entropy of the policy's next-token distribution at loss
    token ``t`` (temperature-scaled, without the suppressed tokens, over the whole vocabulary
    even with ``top_p < 1``), aggregated as the rest of the loss: a push against collapsing onto
    one answer, spread over every token of the vocabulary (docs/grpo.md, *Entropy bonus*, has what
    it did on the spatial task). 0: none (not computed)."""
    loss_agg: LossAgg = "token_mean"
    """How per-token losses become the batch loss (module docstring, *Loss aggregation*)."""
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
        """The learning rate of optimizer update ``update`` (1 for the first; module docstring)."""
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
    """Loss tokens outside the trainer's top-p nucleus (kept with their own mass, module docstring)."""
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


def media_kwargs(batch: TrainBatch) -> dict[str, torch.Tensor]:
    """The model's media inputs for ``batch``: each media key materialized in row order (or absent)."""
    out: dict[str, torch.Tensor] = {}
    for key, packed in batch.media.items():
        dense = packed.materialize()
        if dense is not None:
            out[key] = dense
    return out


def _forward_kwargs(
    model: Any,
    batch: TrainBatch,
    *,
    encoder_dedup: bool = False,
    encoder_stats: EncoderStats | None = None,
) -> dict[str, Any]:
    """The model's forward inputs for ``batch``; with ``encoder_dedup`` the encoders run once per unique
    item (:mod:`gymbridge.trainer.encoder`) where the model allows, else every reference is materialised."""
    from gymbridge.families import family_of
    from gymbridge.tensors.processor import MEDIA_KEY_MODALITY, forward_media_kwargs

    device = next(model.parameters()).device
    params = inspect.signature(model.forward).parameters
    plan = encoder_plan(model, batch.media) if encoder_dedup and encoder_refs(batch.media) else None
    if isinstance(plan, str):
        log_fallback_once(model, plan)
        plan = None
    media = plan.passthrough if plan is not None else media_kwargs(batch)
    try:
        named = forward_media_kwargs(media, params)
    except ValueError as exc:
        raise TrajectoryError(str(exc)) from exc
    # the token stream's own inputs come last: no media key can ever replace them
    kwargs: dict[str, Any] = {}
    model_dtype = next(model.parameters()).dtype
    for key, value in named.items():
        kwargs[key] = value.to(device=device, dtype=model_dtype if value.is_floating_point() else value.dtype)
    kwargs["input_ids"] = batch.input_ids.to(device)
    kwargs["attention_mask"] = batch.attention_mask.to(device)
    config = model.config
    family = family_of(model)
    _check_placeholders(family, config, batch)
    # the family's per-token inputs (Qwen's M-RoPE types, Gemma 3's image blocks), as the generator's
    present = {MEDIA_KEY_MODALITY.get(k, "other") for k in batch.media if batch.media[k].num_refs}
    types = family.token_type_kwargs(config, batch.input_ids, present, params)
    kwargs.update({k: v.to(device) for k, v in types.items()})
    if plan is not None and plan.items:
        kwargs.update(encode_unique(model, plan, kwargs["input_ids"]))
    if encoder_stats is not None:
        encoder_stats.add(plan, batch.media)
    return kwargs


_PLURAL = {"image": "images", "video": "videos", "audio": "audio clips"}


def _check_placeholders(family: ModelFamily, config: Any, batch: TrainBatch) -> None:
    """Each modality's placeholder tokens must equal the features its media imply (else the model cannot run).

    The count is the family's (:meth:`~gymbridge.families.ModelFamily.expected_placeholders`: Qwen's
    ``prod(grid_thw) // merge**2``, Gemma 3's and InternVL's image rows x tokens per image / tile,
    the audio encoder's output length). Images are always checked; a video or audio placeholder in
    a batch without media of that modality is plain text to the model (it never looks features up
    for it), so those are checked when their media are present.
    """
    from gymbridge.tensors.processor import MEDIA_KEY_MODALITY

    ids = family.placeholder_ids(config)
    media = {k: v for k, v in batch.media.items() if v.num_refs}
    for modality in ("image", "video", "audio"):
        tid = ids.get(modality)
        present = any(MEDIA_KEY_MODALITY.get(k) == modality for k in media)
        if tid is None or (modality != "image" and not present):
            continue
        want = family.expected_placeholders(config, modality, media)
        if want is None:
            continue
        have = int((batch.input_ids == tid).sum())
        if have != want:
            per_row = (batch.input_ids == tid).sum(dim=1).tolist()
            raise TrajectoryError(
                f"the batch holds {have} {modality} placeholder tokens but its {_PLURAL[modality]} give "
                f"{want} features (placeholders per row: {per_row}); a generated placeholder token or "
                "media that do not belong to these rows"
            )


def nucleus_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N]`` logprobs of ``targets`` ``[N]`` under the top-p nucleus of ``logits`` ``[N, V]``.

    The nucleus is the generator's (transformers' ``TopPLogitsWarper`` rule): in ascending
    order, tokens whose cumulative probability is ``<= 1 - top_p`` are dropped, the most
    probable token always stays. Membership is computed without gradient; the target is
    always kept (module docstring). Returns ``(logprobs, outside)``, ``outside`` ``[N]`` bool:
    the target lay outside the nucleus. ``logits`` are already temperature-scaled and masked.
    """
    with torch.no_grad():
        ascending, order = torch.sort(logits, dim=-1)
        cumulative = torch.softmax(ascending, dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= 1.0 - top_p
        drop_sorted[..., -1] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        outside = drop.gather(-1, targets[:, None])[:, 0]
        drop.scatter_(-1, targets[:, None], False)
    kept = logits.masked_fill(drop, float("-inf"))
    picked = logits.gather(-1, targets[:, None])[:, 0]
    return picked - torch.logsumexp(kept, dim=-1), outside


def _token_logprobs(
    model: Any,
    batch: TrainBatch,
    *,
    temperature: float,
    suppress_token_ids: Sequence[int] | None,
    top_p: float,
    packed: bool = False,
    encoder_dedup: bool = False,
    encoder_stats: EncoderStats | None = None,
    entropy: bool = False,
) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """:func:`token_logprobs`, the number of loss tokens outside the trainer's nucleus and, with
    ``entropy``, the ``[B, L]`` entropy of each loss token's distribution (0 elsewhere;
    differentiable)."""
    if is_greedy(temperature):  # logits / 1e-40 overflow to inf: the step would be NaN
        raise ValueError(
            f"temperature must be >= {GREEDY_BELOW_TEMPERATURE:g} for a policy-gradient step (below it "
            f"sampling is greedy), got {temperature}"
        )
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    kwargs = _forward_kwargs(model, batch, encoder_dedup=encoder_dedup, encoder_stats=encoder_stats)
    rows: PackedRows | None = None
    if packed:
        kwargs, rows = packed_forward_kwargs(model, kwargs)
    logits = model(**kwargs).logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    ids = (rows.pack(batch.input_ids) if rows is not None else batch.input_ids).to(logits.device)
    logits = logits[:, :-1]
    targets = ids[:, 1:]
    if suppress_token_ids is None:
        suppress_token_ids = media_special_token_ids(model.config)
    suppress = [t for t in suppress_token_ids if 0 <= t < logits.shape[-1]]
    if suppress:
        logits = logits.index_fill(-1, torch.tensor(suppress, device=logits.device), float("-inf"))
    lp = logits.gather(-1, targets[..., None])[..., 0] - torch.logsumexp(logits, dim=-1)
    # a placeholder token of the prompt has logit -inf: keep its (unused, unmasked) value finite
    lp = torch.where(torch.isfinite(lp), lp, torch.zeros_like(lp))
    outside = 0
    ent: torch.Tensor | None = None
    if top_p < 1.0 or entropy:
        # only where the loss looks: a [N, V] sort or softmax, and prompt tokens need neither
        loss_mask = rows.pack(batch.loss_mask) if rows is not None else batch.loss_mask
        where = loss_mask[:, 1:].to(logits.device) > 0
        if top_p < 1.0 and bool(where.any()):
            nucleus, out_mask = nucleus_logprobs(logits[where], targets[where], top_p)
            lp = lp.masked_scatter(where, nucleus)
            outside = int(out_mask.sum())
        if entropy:
            ent = torch.zeros_like(lp).masked_scatter(where, _entropy(logits[where]))
    out = torch.zeros(ids.shape, dtype=lp.dtype, device=lp.device)
    out[:, 1:] = lp
    ent_out: torch.Tensor | None = None
    if ent is not None:
        ent_out = torch.zeros(ids.shape, dtype=ent.dtype, device=ent.device)
        ent_out[:, 1:] = ent
    if rows is not None:  # a row's first token follows the previous row: no logprob there
        return rows.unpack(out), outside, rows.unpack(ent_out) if ent_out is not None else None
    attention = batch.attention_mask.to(out.device)
    return out * attention, outside, ent_out * attention if ent_out is not None else None


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy ``[N]`` of ``softmax(logits)`` ``[N, V]``; ``-inf`` logits (suppressed tokens) have
    probability 0 and add nothing (no NaN in the value or the gradient)."""
    finite = logits.masked_fill(~torch.isfinite(logits), 0.0)
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * finite).sum(dim=-1)


def token_logprobs(
    model: Any,
    batch: TrainBatch,
    *,
    temperature: float = 1.0,
    suppress_token_ids: Sequence[int] | None = None,
    top_p: float = 1.0,
    packed: bool = False,
    encoder_dedup: bool = False,
    encoder_stats: EncoderStats | None = None,
) -> torch.Tensor:
    """``[B, L]`` logprob of each token given the ones before it (0 at position 0 and on padding).

    One teacher-forced forward pass over the whole ``batch`` with its media; differentiable.
    The distribution is renormalised without ``suppress_token_ids`` (default ``None``: the
    model's media placeholder / vision boundary ids, the generator's mask; ``()``: no mask)
    and, with ``top_p < 1``, over the nucleus at every loss-mask position (module docstring).
    ``packed``: the rows run as one packed sequence (:mod:`gymbridge.trainer.packing`); the
    result is unpacked to the same ``[B, L]`` layout. ``encoder_dedup``: encode each unique
    media item once (``GRPOConfig.encoder_dedup``); ``encoder_stats`` counts the encoder work.
    """
    lp, _, _ = _token_logprobs(
        model,
        batch,
        temperature=temperature,
        suppress_token_ids=suppress_token_ids,
        top_p=top_p,
        packed=packed,
        encoder_dedup=encoder_dedup,
        encoder_stats=encoder_stats,
    )
    return lp


def kl_estimate(
    new_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator
) -> torch.Tensor:
    """Per-token estimator of ``KL(pi_theta || pi_ref)`` from sampled-token logprobs (same shape)."""
    log_ratio = ref_logprobs.to(new_logprobs) - new_logprobs  # r = log pi_ref / pi_theta
    if estimator == "k1":
        return -log_ratio
    if estimator in ("k3", "low_var_kl"):
        r = log_ratio.clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
        k3 = torch.exp(r) - r - 1.0
        return k3.clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP) if estimator == "low_var_kl" else k3
    raise ValueError(f"unknown KL estimator {estimator!r} (k1, k3 or low_var_kl)")


def loss_rows(loss_mask: torch.Tensor) -> int:
    """Rows of ``loss_mask`` ``[B, L]`` holding at least one loss token (the ``seq_mean`` normaliser)."""
    return int((loss_mask.sum(dim=1) > 0).sum()) if loss_mask.numel() else 0


def aggregate_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    loss_agg: LossAgg,
    *,
    total_loss_tokens: int,
    total_loss_rows: int,
) -> torch.Tensor:
    """The batch loss from per-token losses ``[B, L]`` and the loss mask (module docstring)."""
    masked = per_token * mask
    if loss_agg == "token_mean":
        return masked.sum() / max(total_loss_tokens, 1)
    row_sums = masked.sum(dim=1)
    if loss_agg == "seq_mean_token_sum":
        return row_sums.sum() / max(total_loss_rows, 1)
    if loss_agg == "seq_mean_token_mean":
        return (row_sums / mask.sum(dim=1).clamp(min=1)).sum() / max(total_loss_rows, 1)
    raise ValueError(f"unknown loss_agg {loss_agg!r}")


def grpo_token_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    total_loss_tokens: int | None = None,
    is_cap: float | None = None,
    loss_agg: LossAgg = "token_mean",
    total_loss_rows: int | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    clip_ratio_c: float | None = None,
    kl_bias_correction: bool = False,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped-ratio PG loss (plus ``kl_coef`` x KL to ``ref_logprobs``) over ``[B, L]`` logprobs.

    ``advantages`` are per row ``[B]``. Returns ``(loss, stats)``: ``loss`` aggregates the
    per-token losses over ``loss_mask`` by ``loss_agg`` with the whole batch's
    ``total_loss_tokens`` / ``total_loss_rows`` (default: this mask's own), so parts of a
    batch sum to the batch's loss. ``stats`` holds ``clipped`` (tokens whose ratio was
    clipped in the active direction), ``capped`` (tokens whose importance weight ``is_cap``
    truncated: value and gradient weight ``min(ratio, is_cap)`` in the unclipped term),
    ``dual_clipped`` (tokens of negative advantage whose loss the dual clip ``clip_ratio_c``
    stopped at ``c * |A|``), ``ratio_sum``, ``kl_sum`` (``old - new``), ``ref_kl_sum`` (the KL
    estimator, before ``kl_bias_correction``'s ratio; 0 without a reference), ``entropy_sum``
    (of ``entropy`` ``[B, L]``, the policy's per-token entropy, 0 without it; with ``entropy_coef``
    the loss subtracts ``entropy_coef * entropy``) and ``max_abs_log`` (the largest ``|new -
    old|``) over masked tokens.
    """
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
    mask = loss_mask.to(device=new_logprobs.device, dtype=new_logprobs.dtype)
    tokens = int(mask.sum()) if total_loss_tokens is None else total_loss_tokens
    rows = loss_rows(mask) if total_loss_rows is None else total_loss_rows
    log_ratio = (new_logprobs - old_logprobs.to(new_logprobs)) * mask
    ratio = torch.exp(log_ratio)
    adv = advantages.to(new_logprobs)[:, None]
    weight = ratio
    if is_cap is not None:  # value is_cap, gradient is_cap * grad log pi (a stop-gradient rescale)
        weight = torch.where(ratio > is_cap, ratio * (is_cap / ratio.detach()), ratio)
    unclipped = weight * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    dual_clipped: torch.Tensor | int = 0
    if clip_ratio_c is not None:  # A < 0: at most c|A|, a constant (no gradient) beyond it
        bound = -clip_ratio_c * adv.expand_as(per_token)
        negative = (adv < 0).expand_as(per_token)
        with torch.no_grad():
            dual_clipped = (negative & (per_token > bound) & (mask > 0)).sum()
        per_token = torch.where(negative, torch.minimum(per_token, bound), per_token)
    ref_kl: torch.Tensor | None = None
    if ref_logprobs is not None:
        ref_kl = kl_estimate(new_logprobs, ref_logprobs, kl_estimator) * mask
        if kl_coef:
            # TRL's bias correction: the sampled token's KL weighted by pi_theta / mu (value 1 on-policy)
            kl_term = ref_kl * ratio if kl_bias_correction else ref_kl
            per_token = per_token + kl_coef * kl_term
    if entropy is not None and entropy_coef:
        per_token = per_token - entropy_coef * entropy.to(per_token)
    loss = aggregate_loss(per_token, mask, loss_agg, total_loss_tokens=tokens, total_loss_rows=rows)
    with torch.no_grad():
        was_clipped = ((clipped < unclipped) & (mask > 0)).sum()
        capped = ((ratio > is_cap) & (mask > 0)).sum() if is_cap is not None else 0
        stats = {
            "clipped": float(was_clipped),
            "capped": float(capped),
            "dual_clipped": float(dual_clipped),
            "ratio_sum": float((ratio * mask).sum()),
            "kl_sum": float((-log_ratio * mask).sum()),
            "ref_kl_sum": float(ref_kl.sum()) if ref_kl is not None else 0.0,
            "entropy_sum": float((entropy.to(mask) * mask).sum()) if entropy is not None else 0.0,
            "max_abs_log": float(log_ratio.abs().max()) if log_ratio.numel() else 0.0,
        }
    return loss, stats


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
    ) -> None:
        """``on_policy``: rollouts come from the current weights (``max_staleness == 0``): guard the ratio."""
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
        self.reference: Any | None = None
        """The frozen reference policy (``kl_coef > 0``; ``None`` otherwise)."""
        if self.config.kl_coef > 0:
            self.freeze_reference()

    def freeze_reference(self) -> None:
        """Take (or re-take) the reference policy: a frozen copy of the policy's current weights.

        The reference is always held in the trainer's dtype (``GRPOConfig.dtype``), whatever the
        policy's dtype when it is taken (a run freezes it after its fp32 warm-up, before the cast),
        so a fresh run, a resumed one and every DP worker score the KL against the same numbers.
        """
        if self.config.kl_coef <= 0:
            raise ValueError("freeze_reference: kl_coef is 0, the trainer keeps no reference policy")
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
    ) -> GradientResult:
        """Gradients of ``batch``'s loss (micro-batched by token budget); the model is not updated.

        ``total_loss_tokens`` / ``total_loss_rows`` are the loss-token count and the count of
        rows holding a loss token of the whole batch this one is part of (default: this batch's
        own), so gradients of parts add up to the whole's. ``batch`` is used as given:
        :meth:`step` calls :meth:`prepare` on the whole batch first.
        """
        started = time.perf_counter()
        cfg = self.config
        total = int(batch.loss_mask.sum()) if total_loss_tokens is None else int(total_loss_tokens)
        rows = loss_rows(batch.loss_mask) if total_loss_rows is None else int(total_loss_rows)
        grads = [torch.zeros_like(p) for p in self.params]
        result = GradientResult(grads, 0.0, int(batch.loss_mask.sum()), 0, 0.0, 0.0)
        if len(batch) == 0 or result.loss_tokens == 0:
            return result
        self.model.eval()
        loss_sum = ratio_sum = kl_sum = ref_kl_sum = entropy_sum = 0.0
        clipped = capped = dual = outside = tokens_run = padding = sequences = 0
        first: tuple[float, float] | None = None
        packed = cfg.sequence_packing
        encoder = EncoderStats()
        for mb in batch.micro_batches(cfg.micro_batch_max_tokens, packed=packed):
            if float(mb.loss_mask.sum()) == 0:
                continue
            score = functools.partial(
                _token_logprobs,
                batch=mb,
                temperature=cfg.temperature,
                suppress_token_ids=cfg.suppress_token_ids,
                top_p=cfg.top_p,
                packed=packed,
                encoder_dedup=cfg.encoder_dedup,
            )
            new_lp, mb_outside, mb_entropy = score(
                self.model, encoder_stats=encoder, entropy=cfg.entropy_coef > 0
            )
            ref_lp: torch.Tensor | None = None
            if self.reference is not None:
                with torch.no_grad():
                    ref_lp, _, _ = score(self.reference)
            run = mb.num_tokens if packed else len(mb) * mb.seq_len
            tokens_run += run
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
            part = torch.autograd.grad(loss, self.params, allow_unused=True)
            for acc, g in zip(grads, part, strict=True):
                if g is not None:
                    acc.add_(g)
            if first is None:
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

    def apply_gradients(self, grads: list[torch.Tensor]) -> float:
        """Set ``grads``, clip them to ``max_grad_norm`` (in place), step; returns the pre-clip norm."""
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g.to(device=p.device, dtype=p.dtype)
        if self.config.max_grad_norm is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm))
        else:
            norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
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
