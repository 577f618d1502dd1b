"""Forward-input assembly: a :class:`~gymbridge.tensors.TrainBatch` becomes the model's forward
inputs and per-token logprobs.

:func:`token_logprobs` runs one teacher-forced forward pass over a batch with its media: media reach
the model only here, per micro-batch, right before the forward pass (encoded once per unique item,
:mod:`gymbridge.trainer.encoder`, or materialised; :func:`media_kwargs`), under the names its
``forward`` takes; no media key ever replaces the text ``input_ids`` / ``attention_mask``. The
family's per-token inputs (Qwen's M-RoPE types, Gemma 3's image blocks) come from
:mod:`gymbridge.families`; packed rows from :mod:`gymbridge.trainer.packing`. Placeholders are
checked against the media before the forward (a :class:`~gymbridge.errors.TrajectoryError`
otherwise). Suppressed media tokens: docs/generation.md.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from gymbridge.errors import TrajectoryError
from gymbridge.generation.types import GREEDY_BELOW_TEMPERATURE, is_greedy, media_special_token_ids
from gymbridge.trainer.encoder import (
    EncoderStats,
    encode_unique,
    encoder_plan,
    encoder_refs,
    log_fallback_once,
)
from gymbridge.trainer.objective import entropy_of, nucleus_logprobs
from gymbridge.trainer.packing import PackedRows, packed_forward_kwargs

if TYPE_CHECKING:
    from gymbridge.families import ModelFamily
    from gymbridge.tensors import TrainBatch

__all__ = ["forward_kwargs", "media_kwargs", "scored_logprobs", "token_logprobs"]


def media_kwargs(batch: TrainBatch) -> dict[str, torch.Tensor]:
    """The model's media inputs for ``batch``: each media key materialized in row order (or absent)."""
    out: dict[str, torch.Tensor] = {}
    for key, packed in batch.media.items():
        dense = packed.materialize()
        if dense is not None:
            out[key] = dense
    return out


def forward_kwargs(
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


def scored_logprobs(
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
    kwargs = forward_kwargs(model, batch, encoder_dedup=encoder_dedup, encoder_stats=encoder_stats)
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
            ent = torch.zeros_like(lp).masked_scatter(where, entropy_of(logits[where]))
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
    and, with ``top_p < 1``, over the nucleus at every loss-mask position
    (:func:`~gymbridge.trainer.objective.nucleus_logprobs`).
    ``packed``: the rows run as one packed sequence (:mod:`gymbridge.trainer.packing`); the
    result is unpacked to the same ``[B, L]`` layout. ``encoder_dedup``: encode each unique
    media item once (``GRPOConfig.encoder_dedup``); ``encoder_stats`` counts the encoder work.
    """
    lp, _, _ = scored_logprobs(
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
