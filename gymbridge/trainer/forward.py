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

import functools
import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.checkpoint import checkpoint

from gymbridge.errors import TrajectoryError
from gymbridge.generation.types import GREEDY_BELOW_TEMPERATURE, is_greedy, media_special_token_ids
from gymbridge.trainer.encoder import (
    EncoderStats,
    encode_unique,
    encoder_plan,
    encoder_refs,
    log_fallback_once,
)
from gymbridge.trainer.memory import autocast_dtype
from gymbridge.trainer.objective import entropy_of, nucleus_logprobs
from gymbridge.trainer.packing import PackedRows, packed_forward_kwargs

if TYPE_CHECKING:
    from gymbridge.families import ModelFamily
    from gymbridge.tensors import TrainBatch

__all__ = ["LOGITS_CHUNK_POSITIONS", "forward_kwargs", "media_kwargs", "scored_logprobs", "token_logprobs"]


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


LOGITS_CHUNK_POSITIONS = 4096
"""Loss positions per output-head chunk on the lean path: a chunk's ``[n, V]`` fp32 logits are the
largest tensor the step holds at once; with more positions than this, each chunk is recomputed in
the backward instead of kept."""

_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Text-config settings with which a model's ``forward`` changes the output head's logits: such a
model is scored on the full path (its own ``forward``)."""


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
    loss_only: bool = True,
) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """:func:`token_logprobs`, the number of loss tokens outside the trainer's nucleus and, with
    ``entropy``, the ``[B, L]`` entropy of each loss token's distribution (0 elsewhere;
    differentiable).

    ``loss_only`` (the trainer's): the output head and the log-softmax run only at the positions
    whose next token is a loss token (``loss_mask``), in chunks of :data:`LOGITS_CHUNK_POSITIONS`;
    the logprobs there are the full path's, and every other position holds 0. A model without a
    separate base and output head (``model.model``, ``get_output_embeddings()``), or whose forward
    changes the head's logits (:data:`_LOGIT_POSTPROCESSING`), runs the full path. The forward runs
    under the autocast dtype :func:`~gymbridge.trainer.memory.enable_autocast` set on ``model``.
    """
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
    split = _base_and_head(model) if loss_only else None
    cast = autocast_dtype(model)
    device = next(model.parameters()).device
    with torch.autocast(device.type, dtype=cast or torch.bfloat16, enabled=cast is not None):
        if split is None:
            logits = model(**_without_cache(model, kwargs)).logits
        else:
            base, head = split
            out = base(**_without_cache(base, kwargs))
            hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    ids = (rows.pack(batch.input_ids) if rows is not None else batch.input_ids).to(device)
    loss_mask = rows.pack(batch.loss_mask) if rows is not None else batch.loss_mask
    where = loss_mask[:, 1:].to(device) > 0
    targets = ids[:, 1:]
    if suppress_token_ids is None:
        suppress_token_ids = media_special_token_ids(model.config)
    if split is None:
        lp, outside, ent = _score_all(
            logits.float()[:, :-1], targets, where, temperature, suppress_token_ids, top_p, entropy
        )
    else:
        lp, outside, ent = _score_loss_positions(
            hidden[:, :-1], head, targets, where, temperature, suppress_token_ids, top_p, entropy, cast
        )
    out_lp = torch.zeros(ids.shape, dtype=lp.dtype, device=lp.device)
    out_lp[:, 1:] = lp
    ent_out: torch.Tensor | None = None
    if ent is not None:
        ent_out = torch.zeros(ids.shape, dtype=ent.dtype, device=ent.device)
        ent_out[:, 1:] = ent
    if rows is not None:  # a row's first token follows the previous row: no logprob there
        return rows.unpack(out_lp), outside, rows.unpack(ent_out) if ent_out is not None else None
    attention = batch.attention_mask.to(out_lp.device)
    return out_lp * attention, outside, ent_out * attention if ent_out is not None else None


def _without_cache(module: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with ``use_cache=False`` where ``module``'s forward names it: a teacher-forced pass
    keeps no KV cache (and a checkpointed block, run again in the backward, must not append to one)."""
    if "use_cache" in inspect.signature(module.forward).parameters:
        return {**kwargs, "use_cache": False}
    return kwargs


def _base_and_head(model: Any) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """``(model.model, model.get_output_embeddings())`` when the model's logits are exactly the head
    applied to the base's last hidden state (``None``: score on the full path)."""
    base = getattr(model, "model", None)
    get_head = getattr(model, "get_output_embeddings", None)
    if not isinstance(base, torch.nn.Module) or get_head is None:
        return None
    head = get_head()
    if not isinstance(head, torch.nn.Module):
        return None
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if any(getattr(text, name, None) not in (None, 1.0) for name in _LOGIT_POSTPROCESSING):
        return None
    return base, head


def _scaled_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, suppress_token_ids: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` ``[..., V]`` divided by ``temperature`` with the suppressed tokens at ``-inf``, and the
    logprobs ``[...]`` of ``targets`` under them (0 where not finite)."""
    if temperature != 1.0:
        logits = logits / temperature
    suppress = [t for t in suppress_token_ids if 0 <= t < logits.shape[-1]]
    if suppress:
        logits = logits.index_fill(-1, torch.tensor(suppress, device=logits.device), float("-inf"))
    lp = logits.gather(-1, targets[..., None])[..., 0] - torch.logsumexp(logits, dim=-1)
    # a placeholder token of the prompt has logit -inf: keep its (unused, unmasked) value finite
    return logits, torch.where(torch.isfinite(lp), lp, torch.zeros_like(lp))


def _score_all(
    logits: torch.Tensor,
    targets: torch.Tensor,
    where: torch.Tensor,
    temperature: float,
    suppress_token_ids: Sequence[int],
    top_p: float,
    entropy: bool,
) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """Scores from every position's fp32 ``logits`` ``[B, L-1, V]``: ``[B, L-1]`` logprobs of
    ``targets`` (nucleus and entropy at the loss positions ``where``)."""
    logits, lp = _scaled_logprobs(logits, targets, temperature, suppress_token_ids)
    outside = 0
    ent: torch.Tensor | None = None
    if top_p < 1.0 or entropy:
        # only where the loss looks: a [N, V] sort or softmax, and prompt tokens need neither
        if top_p < 1.0 and bool(where.any()):
            nucleus, out_mask = nucleus_logprobs(logits[where], targets[where], top_p)
            lp = lp.masked_scatter(where, nucleus)
            outside = int(out_mask.sum())
        if entropy:
            ent = torch.zeros_like(lp).masked_scatter(where, entropy_of(logits[where]))
    return lp, outside, ent


def _score_chunk(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: torch.nn.Module,
    temperature: float,
    suppress_token_ids: Sequence[int],
    top_p: float,
    entropy: bool,
    cast: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logprobs [n], outside [n] bool, entropy [n] or [0])`` of ``targets`` ``[n]`` from the base's
    ``hidden`` ``[n, H]`` (the output head runs here, under the forward's autocast)."""
    with torch.autocast(hidden.device.type, dtype=cast or torch.bfloat16, enabled=cast is not None):
        logits = head(hidden)
    logits, lp = _scaled_logprobs(logits.float(), targets, temperature, suppress_token_ids)
    outside = torch.zeros_like(targets, dtype=torch.bool)
    if top_p < 1.0:
        lp, outside = nucleus_logprobs(logits, targets, top_p)
    ent = entropy_of(logits) if entropy else logits.new_zeros(0)
    return lp, outside, ent


def _score_loss_positions(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    targets: torch.Tensor,
    where: torch.Tensor,
    temperature: float,
    suppress_token_ids: Sequence[int],
    top_p: float,
    entropy: bool,
    cast: torch.dtype | None,
) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """Scores at the loss positions ``where`` ``[B, L-1]`` only, from the base's ``hidden``
    ``[B, L-1, H]``: ``[B, L-1]`` logprobs (0 elsewhere), tokens outside the nucleus, entropy."""
    picked = hidden[where]
    chosen = targets[where]
    score = functools.partial(
        _score_chunk,
        head=head,
        temperature=temperature,
        suppress_token_ids=suppress_token_ids,
        top_p=top_p,
        entropy=entropy,
        cast=cast,
    )
    chunked = picked.shape[0] > LOGITS_CHUNK_POSITIONS and torch.is_grad_enabled()
    chunks = zip(
        torch.split(picked, LOGITS_CHUNK_POSITIONS), torch.split(chosen, LOGITS_CHUNK_POSITIONS), strict=True
    )
    parts = [checkpoint(score, h, t, use_reentrant=False) if chunked else score(h, t) for h, t in chunks]
    if parts:
        lp_sel = torch.cat([p[0] for p in parts])
        outside = int(torch.cat([p[1] for p in parts]).sum())
    else:
        lp_sel, outside = hidden.new_zeros(0, dtype=torch.float32), 0
    lp = torch.zeros(where.shape, dtype=torch.float32, device=hidden.device).masked_scatter(where, lp_sel)
    ent: torch.Tensor | None = None
    if entropy:
        ent_sel = torch.cat([p[2] for p in parts]) if parts else lp_sel
        ent = torch.zeros_like(lp).masked_scatter(where, ent_sel)
    return lp, outside, ent


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

    One teacher-forced forward pass over the whole ``batch`` with its media; differentiable; every
    position scored (the trainer's own pass scores only the loss positions, :func:`scored_logprobs`).
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
        loss_only=False,
    )
    return lp
