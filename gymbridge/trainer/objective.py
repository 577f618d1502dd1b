"""The GRPO objective as pure functions of tensors: no model, no optimizer, no I/O.

A :class:`~gymbridge.tensors.TrainBatch` has ``B`` rows of ``L`` tokens. For row ``b`` and position
``t >= 1`` the new logprob is ``log_softmax(logits[b, t-1] / T)[ids[b, t]]`` (``T`` the rollouts'
temperature; over the rollouts' top-p nucleus, :func:`nucleus_logprobs`, and without the suppressed
media tokens, as the generator sampled: :mod:`gymbridge.trainer.forward`); the old one is
``batch.logprobs[b, t]``, the generator's. With ``ratio = exp(new - old)`` and the row's advantage
``A`` the per-token loss is ``-min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)``, plus
``kl_coef * KL_t`` to a frozen reference (:func:`kl_estimate`), minus ``entropy_coef * H_t`` (the
policy's entropy at that token), under the batch's ``loss_mask``, aggregated by
:func:`aggregate_loss` (:func:`grpo_token_loss`).

Invariant: every aggregate divides by the **whole** batch's normaliser (``total_loss_tokens`` /
``total_loss_rows``), so the losses and gradients of a batch's parts (micro-batches, DP shards)
sum to the whole batch's.

The variants and their formulas: docs/grpo.md.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = [
    "KLEstimator",
    "LossAgg",
    "aggregate_loss",
    "entropy_of",
    "grpo_token_loss",
    "kl_estimate",
    "loss_rows",
    "nucleus_logprobs",
]

LossAgg = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"]
KLEstimator = Literal["k1", "k3", "low_var_kl"]
KL_LOG_RATIO_CLAMP = 20.0
"""``|ref - new|`` bound inside the k3 estimator (``exp(20)`` ~ 5e8: large, never infinite)."""
LOW_VAR_KL_CLAMP = 10.0
"""``low_var_kl``: k3's value is clamped to ``[-10, 10]`` (verl's ``low_var_kl``; k3 >= 0, so only
the upper bound acts: tokens with ``ref - new > 2.61`` or ``new - ref > 11.0``)."""


def nucleus_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N]`` logprobs of ``targets`` ``[N]`` under the top-p nucleus of ``logits`` ``[N, V]``.

    The nucleus is the generator's (transformers' ``TopPLogitsWarper`` rule): in ascending
    order, tokens whose cumulative probability is ``<= 1 - top_p`` are dropped, the most
    probable token always stays. Membership is computed without gradient; the target is
    always kept (docs/grpo.md, *Top-p*). Returns ``(logprobs, outside)``, ``outside`` ``[N]`` bool:
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


def entropy_of(logits: torch.Tensor) -> torch.Tensor:
    """Entropy ``[N]`` of ``softmax(logits)`` ``[N, V]``; ``-inf`` logits (suppressed tokens) have
    probability 0 and add nothing (no NaN in the value or the gradient)."""
    finite = logits.masked_fill(~torch.isfinite(logits), 0.0)
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * finite).sum(dim=-1)


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
    """The batch loss from per-token losses ``[B, L]`` and the loss mask (docs/grpo.md,
    *Loss aggregation*)."""
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
