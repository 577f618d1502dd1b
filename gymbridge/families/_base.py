"""The family adapter interface and its generic rules (a grid-based VLM: Qwen-VL's layout).

Every model-dependent decision of gymbridge goes through one :class:`ModelFamily` method; a
family overrides only what its model does differently. The base class holds the rules that
follow from the processor's outputs and the model config alone (placeholder ids from the
config's ``*_token_id``, counts from ``*_grid_thw // merge_size**2``, ``mm_token_type_ids`` when
the forward takes them, encoders called with their grid), which are Qwen-VL's and those of any
model that lays media out the same way.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from gymbridge.hf_config import model_sub_configs

if TYPE_CHECKING:
    from gymbridge.tensors.packed import PackedTensor

__all__ = [
    "GENERIC",
    "MODALITIES",
    "ModelFamily",
    "audio_output_length",
    "collapse_runs",
    "num_placeholders",
    "referenced_rows",
    "sub_processors",
]

MODALITIES: tuple[str, ...] = ("image", "video", "audio")

_GRID_KEYS = {"image": "image_grid_thw", "video": "video_grid_thw"}
_TYPE_CODES = {"image": 1, "video": 2}


def _int_attr(obj: Any, name: str) -> int | None:
    value = getattr(obj, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _configs(config: Any) -> tuple[Any, ...]:
    """``config`` and its sub-configs that carry token ids (a whole Qwen2.5-Omni checkpoint's thinker)."""
    return tuple(model_sub_configs(config))


def collapse_runs(
    prompt_token_ids: Sequence[int], collapse: Mapping[int, str]
) -> tuple[list[int], dict[str, int]]:
    """``prompt_token_ids`` with each run of a placeholder id (``collapse``: id -> modality) cut to one
    token, and the runs counted per modality."""
    out: list[int] = []
    runs = dict.fromkeys(collapse.values(), 0)
    previous: int | None = None
    for token in prompt_token_ids:
        if token in collapse and token == previous:
            continue
        if token in collapse:
            runs[collapse[token]] += 1
        out.append(token)
        previous = token
    return out, runs


def referenced_rows(pack: PackedTensor | None) -> int:
    """Rows along ``pack_dim`` of every reference of ``pack`` (each copy counted), without materialising."""
    if pack is None or not pack.num_refs:
        return 0
    sizes = [int(seg.shape[pack.pack_dim]) for seg in pack.segments]
    return sum(sizes[r] for r in pack.refs.tolist())


def audio_output_length(feature_frames: int) -> int:
    """Audio placeholder tokens for ``feature_frames`` valid mel frames (Qwen2-Audio / Qwen2.5-Omni).

    The encoder's conv stem halves the frames (stride 2), then a stride-2 pooling halves them again.
    """
    after_conv = (feature_frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


def _merge_size(sub: Any) -> int:
    return int(getattr(sub, "merge_size", 1) or 1)


def num_placeholders(modality: str, outputs: dict[str, torch.Tensor], sub: Any) -> int | None:
    """Placeholder tokens one processed medium occupies through its sub-processor ``sub``, or ``None``.

    ``prod(grid_thw) // merge_size**2`` for a Qwen-style grid; for audio, each clip's valid
    ``feature_attention_mask`` frames through the processor's ``num_audio_tokens`` when it has one,
    else :func:`audio_output_length`; ``None`` when the outputs give no way to know.
    """
    grid_key = _GRID_KEYS.get(modality)
    if grid_key is not None and grid_key in outputs:
        grid = outputs[grid_key].to(torch.int64)
        return int(grid.prod(dim=-1).sum()) // (_merge_size(sub) ** 2)
    if modality == "audio" and "feature_attention_mask" in outputs:
        frames = outputs["feature_attention_mask"].to(torch.int64).sum(dim=-1)
        custom = getattr(sub, "num_audio_tokens", None)
        if callable(custom):
            return int(sum(int(custom(int(f))) for f in frames.tolist()))
        return int(sum(audio_output_length(int(f)) for f in frames.tolist()))
    return None


def sub_processors(processor: Any) -> dict[str, Any]:
    """Modality -> the part of a Hugging Face ``processor`` that handles it.

    ``image_processor`` (or the processor itself when it is a bare image processor),
    ``video_processor`` and ``feature_extractor`` (audio); a modality it lacks is absent.
    """
    subs: dict[str, Any] = {}
    image_proc = getattr(processor, "image_processor", None)
    if image_proc is None and "pixel_values" in getattr(processor, "model_input_names", ()):
        image_proc = processor  # a bare image processor
    if image_proc is not None:
        subs["image"] = image_proc
    if (video_proc := getattr(processor, "video_processor", None)) is not None:
        subs["video"] = video_proc
    if (audio_proc := getattr(processor, "feature_extractor", None)) is not None:
        subs["audio"] = audio_proc
    return subs


class ModelFamily:
    """One model family's rules (see the package docstring); this class holds the generic ones."""

    name: ClassVar[str] = "generic"
    model_types: ClassVar[frozenset[str]] = frozenset()
    """``config.model_type`` values of the family."""
    processor_classes: ClassVar[frozenset[str]] = frozenset()
    """Processor class names of the family (matched along the processor's MRO)."""
    end_of_turn: ClassVar[str | None] = None
    """The chat template's end-of-turn marker (``None``: the tokenizer's eos token)."""
    processor_only_keys: ClassVar[frozenset[str]] = frozenset()
    """Image-processor outputs that only size the text expansion and are no model input (``num_crops``)."""
    positions: ClassVar[str] = "1-D"
    """How the language model places tokens (docs): ``1-D`` or an M-RoPE variant."""

    def __repr__(self) -> str:
        return f"<ModelFamily {self.name}>"

    # ------------------------------------------------------------------ token ids

    def placeholder_ids(self, config: Any) -> dict[str, int]:
        """Modality -> the token an item expands to in the model's input (``config.image_token_id``...)."""
        out: dict[str, int] = {}
        for cfg in _configs(config):
            for modality in MODALITIES:
                for attr in (f"{modality}_token_id", f"{modality}_token_index"):
                    value = _int_attr(cfg, attr)
                    if value is not None:
                        out.setdefault(modality, value)
        return out

    def processor_placeholder_ids(self, processor: Any) -> dict[str, int]:
        """The same ids read from a processor (``processor.image_token_id`` or its ``image_token``)."""
        out: dict[str, int] = {}
        tokenizer = getattr(processor, "tokenizer", None)
        for modality in MODALITIES:
            value = _int_attr(processor, f"{modality}_token_id")
            if value is None:
                token = getattr(processor, f"{modality}_token", None)
                if isinstance(token, str) and token and tokenizer is not None:
                    tid = tokenizer.convert_tokens_to_ids(token)
                    value = tid if isinstance(tid, int) else None
            if value is not None:
                out[modality] = value
        return out

    # ------------------------------------------------------------------ placeholder counts

    def num_placeholders(
        self, modality: str, outputs: Mapping[str, torch.Tensor], processor: Any
    ) -> int | None:
        """Placeholder tokens one processed item occupies (``None``: the processor gives no way to know)."""
        sub = sub_processors(processor).get(modality, processor)
        return num_placeholders(modality, dict(outputs), sub)

    def expected_placeholders(
        self, config: Any, modality: str, media: Mapping[str, PackedTensor]
    ) -> int | None:
        """Placeholder tokens a batch's ``media`` (every reference counted) fill (``None``: not checkable).

        Images and videos: ``prod(grid_thw) // spatial_merge_size**2``; audio: the encoder's output
        length of each clip's ``feature_attention_mask`` frames.
        """
        grid_key = _GRID_KEYS.get(modality)
        if grid_key is not None:
            merge = int(getattr(getattr(config, "vision_config", None), "spatial_merge_size", 0) or 0)
            if not merge:
                return None
            grid = media[grid_key].materialize() if grid_key in media else None
            return int(grid.to(torch.int64).prod(dim=-1).sum()) // (merge * merge) if grid is not None else 0
        mask = media["feature_attention_mask"].materialize() if "feature_attention_mask" in media else None
        frames = mask.to(torch.int64).sum(dim=-1).tolist() if mask is not None else []
        return sum(audio_output_length(int(f)) for f in frames)

    # ------------------------------------------------------------------ prompt text

    def placeholder_text(self, processor: Any, modality: str) -> str | None:
        """The text the chat template writes for one item (``None``: the family has none for it)."""
        token = getattr(processor, f"{modality}_token", None)
        return token if isinstance(token, str) and token else None

    def expansion(self, processor: Any, modality: str, count: int) -> str | None:
        """The text one item of ``count`` placeholder tokens expands to (``None``: only the processor
        can write it). Generic: the processor's ``image_token`` repeated."""
        token = self.placeholder_text(processor, modality)
        return None if token is None else token * count

    # ------------------------------------------------------------------ forward inputs

    def token_type_kwargs(
        self, config: Any, input_ids: torch.Tensor, present: Iterable[str], forward_params: Iterable[str]
    ) -> dict[str, torch.Tensor]:
        """Per-token modality inputs the forward needs besides the media (``[B, L]``).

        Generic: ``mm_token_type_ids`` (0 text, 1 image, 2 video) when the forward takes it and
        media are present, marking only the present modalities' placeholders (a stray placeholder
        id without media is text, not a crash): what Qwen-VL's M-RoPE index reads.
        """
        present = set(present)
        if not present or "mm_token_type_ids" not in set(forward_params):
            return {}
        ids = self.placeholder_ids(config)
        types = torch.zeros_like(input_ids, dtype=torch.int32)
        for modality, code in _TYPE_CODES.items():
            tid = ids.get(modality)
            if tid is not None and modality in present:
                types[input_ids == tid] = code
        return {"mm_token_type_ids": types}

    # ------------------------------------------------------------------ encoders

    def encoder_keys(self, modality: str) -> tuple[str, tuple[str, ...]] | None:
        """The key ``get_<modality>_features`` consumes and the per-item keys it takes with it."""
        return {
            "image": ("pixel_values", ("image_grid_thw",)),
            "video": ("pixel_values_videos", ("video_grid_thw",)),
            "audio": ("input_features", ("feature_attention_mask",)),
        }.get(modality)

    def encoder_reason(self, model: Any, modality: str) -> str | None:
        """Why ``model`` cannot take ``modality``'s encoder outputs from outside (``None``: it can)."""
        getter = f"get_{modality}_features"
        if not callable(getattr(model, getter, None)):
            return f"{type(model).__name__} has no {getter}"
        params = set(inspect.signature(model.forward).parameters)
        if modality in ("image", "video"):
            if "mm_encoder_outputs" not in params:
                return f"{type(model).__name__}.forward takes no mm_encoder_outputs"
            return None
        return f"{self.name}: audio features are not taken from outside the forward"

    def encode(self, model: Any, modality: str, inputs: Mapping[str, torch.Tensor]) -> Any:
        """Run ``modality``'s encoder on the unique items' ``inputs`` (its key and per-item keys)."""
        keys = self.encoder_keys(modality)
        assert keys is not None
        primary, side = keys
        getter = getattr(model, f"get_{modality}_features")
        return getter(inputs[primary], *(inputs[k] for k in side), return_dict=True)

    # ------------------------------------------------------------------ packing

    packs_own_masks: ClassVar[bool] = False
    """Whether :meth:`packed_attention_mask` builds the packed masks (then sliding-window layers pack)."""

    def packed_attention_mask(self, model: Any, rows: Any, packed: Mapping[str, Any]) -> Any | None:
        """The attention mask of a packed sequence if the family needs its own (``None``: block-diagonal
        causal). ``rows``: its :class:`~gymbridge.trainer.packing.PackedRows`; ``packed``: its inputs."""
        return None

    # ------------------------------------------------------------------ vLLM

    def vllm_prompt(
        self, prompt_token_ids: Sequence[int], media_counts: Mapping[str, int], config: Any, tokenizer: Any
    ) -> tuple[list[int], dict[str, int]]:
        """The prompt as vLLM's processor takes it: each item's expansion cut back to its one placeholder.

        Returns the ids and the items found per modality (the caller checks them against the media).
        Generic: every run of a modality's placeholder id becomes one token.
        """
        ids = self.placeholder_ids(config)
        collapse = {ids[m]: m for m, n in media_counts.items() if n and m in ids}
        return collapse_runs(prompt_token_ids, collapse)


GENERIC = ModelFamily()
"""The generic rules: a model of no known family."""
