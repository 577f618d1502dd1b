"""Sequence packing for the GRPO step: a micro-batch's rows as one sequence, with the model's own positions.

With ``GRPOConfig.sequence_packing`` the trainer groups rows by real tokens
(:meth:`~gymbridge.tensors.TrainBatch.micro_batches` with ``packed=True``) and runs each micro-batch
``[B, L]`` as one packed sequence ``[1, S]``: :func:`packed_forward_kwargs` turns the padded forward
inputs into packed ones and :meth:`PackedRows.unpack` puts per-token values back at each row's
positions, so the loss code sees the same ``[B, L]`` tensors as without packing.

Invariants (a packed forward equals the padded one: logprobs, loss and gradients within fp32
tolerance, tested on every tiny family):

* no cross-row attention: a block-diagonal causal mask (a dense 4-D mask for ``eager`` / ``sdpa``;
  per-row text positions for ``flash_attention_*`` / ``flex_attention``), or the family's own
  packed masks (:meth:`~gymbridge.families.ModelFamily.packed_attention_mask`);
* each row keeps the position ids the model's own ``get_rope_index`` gives it in the padded
  micro-batch (M-RoPE), else 1-D positions restarting at 0;
* rows keep their batch order, so the micro-batch's media meet their placeholders in order;
* a row's first token gets logprob 0, as on the padded path;
* a model packing cannot run exactly is refused up front by :func:`check_packable` with a
  :class:`~gymbridge.errors.ConfigError`, never run with wrong positions.

The rules in detail: docs/loop.md, "Sequence packing".
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gymbridge.errors import ConfigError
from gymbridge.families import family_of

__all__ = ["PackedRows", "check_packable", "packed_forward_kwargs", "rope_position_ids"]

_DENSE_MASK_IMPLS = ("eager", "sdpa")
"""Attention implementations given an explicit 4-D block-diagonal mask."""
_POSITION_ROUTE_PREFIXES = ("flash_attention", "flex_attention")
"""Implementations that find packed rows from the text position ids (mask ``None``)."""
_TOKEN_KEYS = ("input_ids", "mm_token_type_ids", "token_type_ids")
"""Per-token ``[B, L]`` forward inputs that are packed like ``input_ids``."""


@dataclass(frozen=True)
class PackedRows:
    """Where the real tokens of a micro-batch ``[B, L]`` sit in its packed sequence ``[1, S]``.

    ``flat_index`` int64 ``[S]``: position of packed token ``j`` in the flattened ``[B * L]``
    micro-batch (row-major over the attention mask's nonzero entries: rows in order, tokens in
    order); ``lengths`` / ``starts`` int64 ``[B]``: each row's token count and its first packed
    position; ``text_positions`` int64 ``[S]``: the token's index within its row.
    """

    flat_index: torch.Tensor
    lengths: torch.Tensor
    starts: torch.Tensor
    text_positions: torch.Tensor
    shape: tuple[int, int]

    @classmethod
    def of(cls, attention_mask: torch.Tensor) -> PackedRows:
        """The packing of a ``[B, L]`` 0/1 attention mask."""
        valid = attention_mask.to(torch.bool)
        lengths = valid.sum(dim=1).to(torch.int64)
        flat_index = valid.reshape(-1).nonzero().reshape(-1)
        text_positions = (valid.to(torch.int64).cumsum(dim=1) - 1).reshape(-1)[flat_index]
        starts = lengths.cumsum(0) - lengths
        b, length = valid.shape
        return cls(flat_index, lengths, starts, text_positions, (int(b), int(length)))

    @property
    def num_tokens(self) -> int:
        """``S``: the packed sequence's length."""
        return int(self.flat_index.numel())

    def pack(self, values: torch.Tensor) -> torch.Tensor:
        """``[B, L, *rest]`` -> ``[1, S, *rest]``: the real tokens' values in packed order."""
        flat = values.reshape(self.shape[0] * self.shape[1], *values.shape[2:])
        return flat[self.flat_index.to(flat.device)].unsqueeze(0)

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """``[1, S]`` -> ``[B, L]``: each value back at its row's position; 0 on padding and at row starts.

        Differentiable in ``values`` (a scatter into zeros).
        """
        flat = values.new_zeros(self.shape[0] * self.shape[1])
        keep = (self.text_positions > 0).to(values.device)
        index = self.flat_index.to(values.device)
        flat = flat.index_put((index,), values.reshape(-1) * keep.to(values.dtype))
        return flat.reshape(self.shape)

    def sequence_ids(self) -> torch.Tensor:
        """int64 ``[S]``: the micro-batch row each packed token belongs to."""
        rows = torch.arange(self.shape[0], device=self.lengths.device)
        return torch.repeat_interleave(rows, self.lengths)

    def causal_mask(self, *, additive_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The block-diagonal causal mask ``[1, 1, S, S]``: token ``q`` sees ``k <= q`` of its own row.

        Boolean (True: attend; what ``sdpa`` takes) or, with ``additive_dtype``, 0 / the
        dtype's minimum (what ``eager`` adds to the attention scores).
        """
        seq = self.sequence_ids()
        same_row = seq[:, None] == seq[None, :]
        allowed = torch.tril(same_row)[None, None]
        if additive_dtype is None:
            return allowed
        blocked = torch.full(
            allowed.shape, torch.finfo(additive_dtype).min, dtype=additive_dtype, device=allowed.device
        )
        return blocked.masked_fill(allowed, 0.0)


def _text_config(model: Any) -> Any:
    config = model.config
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _attn_implementation(model: Any) -> str:
    impl = getattr(_text_config(model), "_attn_implementation", None) or getattr(
        model.config, "_attn_implementation", None
    )
    return str(impl or "eager")


def _rope_index_fn(model: Any) -> Callable[..., Any] | None:
    """The model's ``get_rope_index`` (on the model or its inner ``model``), if it has one."""
    for owner in (model, getattr(model, "model", None)):
        fn = getattr(owner, "get_rope_index", None) if owner is not None else None
        if callable(fn):
            return fn  # type: ignore[no-any-return]
    return None


def _rope_index_sources(kwargs: dict[str, Any]) -> dict[str, Any]:
    """What a ``get_rope_index`` may ask for, from the padded forward kwargs, by the names models use."""
    ids: torch.Tensor = kwargs["input_ids"]
    seconds = kwargs.get("video_second_per_grid", kwargs.get("second_per_grid_ts"))
    features_mask = kwargs.get("feature_attention_mask")
    types = kwargs.get("mm_token_type_ids")
    sources = {
        "input_ids": ids,
        "attention_mask": kwargs["attention_mask"],
        # no media in the micro-batch: every token is text (what the model's own forward assumes)
        "mm_token_type_ids": types if types is not None else torch.zeros_like(ids, dtype=torch.int32),
        "image_grid_thw": kwargs.get("image_grid_thw"),
        "video_grid_thw": kwargs.get("video_grid_thw"),
        "second_per_grids": seconds,
        "second_per_grid_ts": seconds,
        "video_second_per_grid": seconds,
        "audio_seqlens": features_mask.sum(dim=1) if features_mask is not None else None,
        "audio_feature_lengths": features_mask.sum(dim=1) if features_mask is not None else None,
        "use_audio_in_video": bool(kwargs.get("use_audio_in_video") or False),
    }
    assert sources.keys() == _ROPE_INDEX_INPUTS
    return sources


_ROPE_INDEX_INPUTS = frozenset(
    (
        "input_ids",
        "attention_mask",
        "mm_token_type_ids",
        "image_grid_thw",
        "video_grid_thw",
        "second_per_grids",
        "second_per_grid_ts",
        "video_second_per_grid",
        "audio_seqlens",
        "audio_feature_lengths",
        "use_audio_in_video",
    )
)
"""The ``get_rope_index`` arguments :func:`_rope_index_sources` supplies."""


def _unknown_rope_args(fn: Callable[..., Any]) -> list[str]:
    """Required ``get_rope_index`` arguments the trainer cannot supply."""
    out = []
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or name in _ROPE_INDEX_INPUTS:
            continue
        if p.default is inspect.Parameter.empty:
            out.append(name)
    return out


def rope_position_ids(model: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The model's own position ids ``[3, B, L]`` for its padded forward ``kwargs`` (``None``: 1-D model).

    Calls the model's ``get_rope_index`` with what its forward would pass it (module docstring).
    """
    fn = _rope_index_fn(model)
    if fn is None:
        return None
    sources = _rope_index_sources(kwargs)
    params = inspect.signature(fn).parameters
    args = {name: sources[name] for name in params if name in sources}
    positions, _deltas = fn(**args)
    return positions  # type: ignore[no-any-return]


def check_packable(model: Any) -> None:
    """Refuse (``ConfigError``) a model whose packed forward would not equal its padded one."""
    problems: list[str] = []
    name = type(model).__name__
    impl = _attn_implementation(model)
    dense = impl in _DENSE_MASK_IMPLS
    if not dense and not impl.startswith(_POSITION_ROUTE_PREFIXES):
        problems.append(
            f"trainer.sequence_packing: {name} uses attention implementation {impl!r}, which takes neither "
            f"a 4-D block mask ({', '.join(_DENSE_MASK_IMPLS)}) nor packed position ids (flash / flex); "
            "set trainer.sequence_packing=false"
        )
    family = family_of(model)
    masks_own = family.packs_own_masks
    layer_types = getattr(_text_config(model), "layer_types", None) or []
    if dense and not masks_own and any(t != "full_attention" for t in layer_types):
        problems.append(
            f"trainer.sequence_packing: {name} has {sorted(set(layer_types) - {'full_attention'})} layers, "
            "which a dense block mask would turn into full attention; set trainer.sequence_packing=false"
        )
    if masks_own and not dense:
        problems.append(
            f"trainer.sequence_packing: {name} ({family.name}) needs its own packed masks, which only the "
            f"{', '.join(_DENSE_MASK_IMPLS)} attention implementations take; it uses {impl!r}"
        )
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        params = {}  # type: ignore[assignment]
    if "position_ids" not in params:
        problems.append(f"trainer.sequence_packing: {name}.forward takes no position_ids")
    fn = _rope_index_fn(model)
    if fn is not None and (missing := _unknown_rope_args(fn)):
        problems.append(
            f"trainer.sequence_packing: {name}.get_rope_index needs {missing}, which the trainer cannot "
            "supply, so its M-RoPE positions cannot be reproduced per packed row"
        )
    if problems:
        raise ConfigError(problems)


def packed_forward_kwargs(model: Any, kwargs: dict[str, Any]) -> tuple[dict[str, Any], PackedRows]:
    """The padded forward ``kwargs`` of a micro-batch ``[B, L]`` as one packed sequence ``[1, S]``.

    ``kwargs`` are what the model's forward takes without packing (media, ``input_ids``,
    ``attention_mask``, ``mm_token_type_ids``); media pass unchanged, per-token inputs are
    packed, ``position_ids`` are the model's own (:func:`rope_position_ids`, gathered per row)
    and the attention mask is block-diagonal (module docstring). Returns the packed kwargs and
    the :class:`PackedRows` that unpacks per-token outputs.
    """
    mask: torch.Tensor = kwargs["attention_mask"]
    if mask.dim() != 2:
        raise ValueError(f"packing needs a [B, L] attention mask, got {tuple(mask.shape)}")
    rows = PackedRows.of(mask)
    rope = rope_position_ids(model, kwargs)
    text = rows.text_positions.to(mask.device)[None]  # [1, S]
    # [3, B, L] -> [3, 1, S] (M-RoPE), or 1-D positions restarting per row
    positions = rows.pack(rope.permute(1, 2, 0)).permute(2, 0, 1) if rope is not None else text
    out = dict(kwargs)
    for key in _TOKEN_KEYS:
        if out.get(key) is not None:
            out[key] = rows.pack(out[key])
    if out.get("inputs_embeds") is not None:
        out["inputs_embeds"] = rows.pack(out["inputs_embeds"])
    impl = _attn_implementation(model)
    own = family_of(model).packed_attention_mask(model, rows, out)
    if own is not None:  # the family's masks (Gemma 3: per layer type, bidirectional images)
        out["attention_mask"] = own
        out["position_ids"] = positions
    elif impl in _DENSE_MASK_IMPLS:
        dtype = next(model.parameters()).dtype if impl == "eager" else None
        out["attention_mask"] = rows.causal_mask(additive_dtype=dtype).to(mask.device)
        out["position_ids"] = positions
    else:
        out["attention_mask"] = None
        out["position_ids"] = torch.cat([text[None], positions]) if positions.dim() == 3 else text
    return out, rows
