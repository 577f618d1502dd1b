"""Media encoders run once per unique item of a micro-batch, their outputs scattered to every reference.

A GRPO group repeats one prompt G times, so a micro-batch's media hold one segment per item but G
references to it; materialising them would encode every copy. :func:`encoder_plan` finds each
modality's unique items (references whose keys, the family's
:meth:`~gymbridge.families.ModelFamily.encoder_keys`, all point at the same segments), the model's
own encoder runs once on those items, and every reference gets its item's outputs (the same
tensors, not copies) through the model's ``mm_encoder_outputs`` (images, video) or filled
``inputs_embeds`` (audio). Grids, masks and timing still go to the model per reference, in row
order, for its M-RoPE positions.

Invariants:

* nothing is merged that the batch's provenance did not already merge;
* loss and every parameter's gradient (encoders included) equal the materialised path's within
  fp32 tolerance: the gather's backward sums the gradients of the rows that share an item;
* where the family cannot take encoder outputs from outside, a media key is unknown, or a
  modality's keys disagree on their references, :func:`encoder_plan` returns the reason instead
  of a plan and the caller materialises (logged once per model class and reason;
  ``encoder_dedup`` reported off).

Details: docs/tensors.md, "Media encoded once per unique item".
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from gymbridge.tensors.packed import PackedTensor

logger = logging.getLogger(__name__)

__all__ = [
    "AUDIO_EMBED_MODEL_TYPES",
    "ENCODER_MODALITIES",
    "EncoderPlan",
    "EncoderStats",
    "ModalityItems",
    "encode_unique",
    "encoder_plan",
    "encoder_refs",
    "log_fallback_once",
    "unique_items",
]

ENCODER_MODALITIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "image": ("pixel_values", ("image_grid_thw",)),
    "video": ("pixel_values_videos", ("video_grid_thw",)),
    "audio": ("input_features", ("feature_attention_mask",)),
}
"""The generic family's encoder keys per modality: the key the encoder consumes and the per-item keys
it takes with it (a family may list others: :meth:`~gymbridge.families.ModelFamily.encoder_keys`)."""

_METADATA_KEYS = frozenset({"video_second_per_grid", "second_per_grid_ts", "audio_feature_lengths"})
"""Per-reference keys the model reads outside its encoders (timing, lengths): passed for every reference."""

AUDIO_EMBED_MODEL_TYPES = frozenset({"qwen2_5_omni_thinker"})
"""Model types whose ``forward`` encodes audio only from ``input_features`` and otherwise reads audio
placeholders from ``inputs_embeds`` (the :class:`~gymbridge.families.QwenOmni` family's)."""

_LOGGED: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class ModalityItems:
    """One modality of a micro-batch: its unique items and which item each reference is."""

    modality: str
    inputs: dict[str, torch.Tensor]
    """The encoder's inputs for the ``U`` unique items (its key and per-item keys), in item order."""
    inverse: torch.Tensor
    """int64 ``[N]``: the unique item of each reference, references in row order."""
    sizes: tuple[int, ...] = ()
    """Rows of the encoder key (its ``pack_dim``) of each unique item, in item order."""

    @property
    def num_items(self) -> int:
        return int(self.inverse.max()) + 1 if self.inverse.numel() else 0

    @property
    def num_refs(self) -> int:
        return int(self.inverse.numel())


@dataclass(frozen=True)
class EncoderPlan:
    """What the deduplicated forward encodes (:func:`encoder_plan`)."""

    items: tuple[ModalityItems, ...]
    passthrough: dict[str, torch.Tensor]
    """Every reference's non-encoder media (grids, masks, timing), materialised in row order."""

    @property
    def segments(self) -> int:
        return sum(m.num_items for m in self.items)

    @property
    def refs(self) -> int:
        return sum(m.num_refs for m in self.items)


def encoder_refs(media: Mapping[str, PackedTensor]) -> int:
    """References the encoders see in ``media`` (items of every modality, each copy counted)."""
    return sum(media[primary].num_refs for primary, _ in ENCODER_MODALITIES.values() if primary in media)


def unique_items(
    modality: str, packs: Mapping[str, PackedTensor], item_keys: tuple[str, tuple[str, ...]] | None = None
) -> ModalityItems | str:
    """``modality``'s unique items over ``packs`` (``item_keys``: its key and per-item keys), or why not.

    ``item_keys`` default to the generic ones (:data:`ENCODER_MODALITIES`). Every key must hold one
    reference per item, rows alike (same ``offsets``); otherwise the reason is returned and
    nothing is merged.
    """
    primary, side = item_keys if item_keys is not None else ENCODER_MODALITIES[modality]
    missing = [k for k in side if k not in packs]
    if missing:
        return f"{modality} key {primary!r} comes without {missing}"
    keys = [primary, *side]
    first = packs[primary]
    for key in keys[1:]:
        if not torch.equal(packs[key].offsets, first.offsets):
            return f"{modality} keys {primary!r} and {key!r} disagree on their references per row"
    refs = torch.stack([packs[k].refs for k in keys])  # [K, N]
    if refs.shape[1] == 0:
        return f"no {modality} references"
    columns, inverse = torch.unique(refs, dim=1, return_inverse=True)  # [K, U], [N]
    inputs: dict[str, torch.Tensor] = {}
    for row, key in enumerate(keys):
        pack = packs[key]
        one_row = PackedTensor(
            pack.segments,
            pack.provenance,
            torch.tensor([0, columns.shape[1]], dtype=torch.int64),
            columns[row],
            pack.pack_dim,
        )
        dense = one_row.materialize()
        assert dense is not None  # columns is non-empty
        inputs[key] = dense
    pack = packs[primary]
    sizes = tuple(int(pack.segments[j].shape[pack.pack_dim]) for j in columns[0].tolist())
    return ModalityItems(modality, inputs, inverse.to(torch.int64), sizes)


def encoder_plan(model: Any, media: Mapping[str, PackedTensor]) -> EncoderPlan | str:
    """The deduplicated encoding of ``media`` (one micro-batch, ``PackedTensor`` per key) for ``model``, or
    the reason it cannot run (module docstring)."""
    from gymbridge.families import MODALITIES, family_of

    family = family_of(model)
    keys = {m: k for m in MODALITIES if (k := family.encoder_keys(m)) is not None}
    handled = {k for primary, side in keys.values() for k in (primary, *side)} | _METADATA_KEYS
    unknown = sorted(k for k in media if k not in handled)
    if unknown:
        return f"media keys of unknown modality {unknown}"
    items: list[ModalityItems] = []
    for modality, (primary, side) in keys.items():
        present = {k: media[k] for k in (primary, *side) if k in media and media[k].num_refs}
        if not present:
            continue
        if primary not in present:
            continue  # grids without pixels: nothing to encode, passed through for the model to judge
        reason = family.encoder_reason(model, modality)
        if reason is None:
            found = unique_items(modality, present, (primary, side))
            if isinstance(found, str):
                reason = found
            else:
                items.append(found)
                continue
        return reason
    encoded = {keys[m.modality][0] for m in items}
    passthrough: dict[str, torch.Tensor] = {}
    for key, pack in media.items():
        dense = None if key in encoded else pack.materialize()
        if dense is not None:
            passthrough[key] = dense
    return EncoderPlan(tuple(items), passthrough)


def log_fallback_once(model: Any, reason: str) -> None:
    """Log (once per model class and reason) that the materialised path runs instead."""
    key = (type(model).__name__, reason)
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    logger.warning("media encoded per reference (materialised path), not once per unique item: %s", reason)


def _cast(value: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)


def encode_unique(model: Any, plan: EncoderPlan, input_ids: torch.Tensor) -> dict[str, Any]:
    """Run ``plan``'s encoders once per unique item and scatter their outputs to every reference.

    ``input_ids`` ``[B, L]`` (on the model's device) locates the audio placeholders. Returns the
    forward inputs that replace the encoder keys: ``mm_encoder_outputs`` (images, video) and
    ``inputs_embeds`` (audio). Differentiable: gradients of shared items are summed over their references.
    """
    from gymbridge.families import family_of

    family = family_of(model)
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    kwargs: dict[str, Any] = {}
    outputs: dict[str, Any] = {}
    for mod in plan.items:
        inputs = {k: _cast(v, device, dtype) for k, v in mod.inputs.items()}
        order = mod.inverse.tolist()
        if mod.modality in ("image", "video"):
            out = family.encode(model, mod.modality, inputs)
            outputs[mod.modality] = _per_reference(out, mod, order)
            continue
        kwargs["inputs_embeds"] = _scatter_audio(model, inputs, order, input_ids, kwargs.get("inputs_embeds"))
    if outputs:
        kwargs["mm_encoder_outputs"] = outputs
    return kwargs


def _per_reference(out: Any, mod: ModalityItems, order: list[int]) -> Any:
    """``out`` (the encoder's outputs for the unique items) laid out again for every reference, in order.

    Per-item outputs are a tuple of one block per item (Qwen's ``pooler_output``; each layer of
    Qwen3-VL's ``deepstack_features``) or one tensor whose rows follow the items' input rows
    (Gemma 3: one image per row; InternVL: one tile per row), split by :attr:`ModalityItems.sizes`.
    """
    name = f"get_{mod.modality}_features"

    def items_of(value: Any, what: str) -> list[Any]:
        if isinstance(value, tuple | list):
            blocks = list(value)
        elif isinstance(value, torch.Tensor) and int(value.shape[0]) == sum(mod.sizes):
            blocks = list(torch.split(value, list(mod.sizes)))
        else:
            rows = value.shape[0] if isinstance(value, torch.Tensor) else type(value).__name__
            raise RuntimeError(f"{name} gave {what} of {rows} rows for items of {list(mod.sizes)} input rows")
        if len(blocks) != mod.num_items:
            raise RuntimeError(f"{name} gave {len(blocks)} {what} blocks for {mod.num_items} items")
        return blocks

    def gather(value: Any, what: str) -> Any:
        blocks = items_of(value, what)
        chosen = [blocks[u] for u in order]
        return tuple(chosen) if isinstance(value, tuple | list) else torch.cat(chosen)

    fields: dict[str, Any] = {"pooler_output": gather(out.pooler_output, "pooler_output")}
    deepstack = getattr(out, "deepstack_features", None)
    if deepstack is not None:
        fields["deepstack_features"] = [gather(layer, "deepstack_features") for layer in deepstack]
    return type(out)(**fields)


def _scatter_audio(
    model: Any,
    inputs: dict[str, torch.Tensor],
    order: list[int],
    input_ids: torch.Tensor,
    embeds: torch.Tensor | None,
) -> torch.Tensor:
    """``inputs_embeds`` ``[B, L, H]``: audio placeholder block ``k`` holds reference ``k``'s output."""
    from gymbridge.tensors.processor import audio_output_length

    mask = inputs["feature_attention_mask"]
    out = model.get_audio_features(inputs["input_features"], mask, return_dict=True)
    features = out.last_hidden_state  # [sum of output lengths, H]
    sizes = [audio_output_length(int(f)) for f in mask.to(torch.int64).sum(dim=-1).tolist()]
    if sum(sizes) != features.shape[0]:
        raise RuntimeError(f"get_audio_features gave {features.shape[0]} frames, expected {sum(sizes)}")
    blocks = torch.split(features, sizes)
    per_ref = torch.cat([blocks[u] for u in order])
    if embeds is None:
        embeds = model.get_input_embeddings()(input_ids)
    assert embeds is not None
    where = (input_ids == model.config.audio_token_id)[..., None].expand_as(embeds)
    return embeds.masked_scatter(where, per_ref.to(embeds.dtype))


@dataclass
class EncoderStats:
    """Encoder work over the forwards it is passed to (counters; :func:`EncoderStats.add` per forward)."""

    segments: int = 0
    """Media items the encoders ran on (each unique item once per forward; every copy when materialised)."""
    refs: int = 0
    """References to media items (placeholder blocks filled), every copy counted."""
    forwards_with_media: int = 0
    deduplicated_forwards: int = 0
    """Forwards with media whose encoders ran once per unique item."""

    def add(self, plan: EncoderPlan | None, media: Mapping[str, PackedTensor]) -> None:
        refs = encoder_refs(media)
        if not refs:
            return
        self.refs += refs
        self.forwards_with_media += 1
        if plan is None:
            self.segments += refs
            return
        self.segments += plan.segments  # a plan encodes every modality whose encoder key has references
        self.deduplicated_forwards += 1

    @property
    def deduplicated(self) -> bool:
        """Every forward with media ran its encoders once per unique item (False when none had media)."""
        return self.forwards_with_media > 0 and self.deduplicated_forwards == self.forwards_with_media
