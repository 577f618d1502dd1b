"""``MediaProcessor``: turn media into model inputs once per content key per batch.

Wraps a Hugging Face processor (a ``ProcessorMixin`` with ``image_processor`` /
``video_processor`` / ``feature_extractor`` attributes, or a bare image processor)
and processes each distinct media content key **once**, whatever the group size G.
Each output key of one item (``pixel_values`` ``[P, D]``, ``image_grid_thw`` ``[1, 3]``,
...) becomes one segment whose provenance is derived from
``(content key, processor spec, output key, dtype)``: two separately loaded copies of
the same bytes share one segment, and a different processor config never collides.

Invariants:

* the processor's ``input_ids`` are never used (the rollout's tokens are authoritative);
  only media outputs are kept;
* every item of a :meth:`MediaProcessor.process` call is processed at most once per
  content key (``stats.items_processed`` counts the sub-processor calls);
* processor failures on an item are raised as ``MediaDecodeError`` naming its source;
* ``num_placeholders(outputs)`` is what the item must occupy in the token stream
  (``prod(grid_thw) // merge_size**2`` for Qwen-style grids; for audio the encoder's
  output length of ``feature_attention_mask.sum()`` frames, Qwen2-Audio / Qwen2.5-Omni's two
  stride-2 stages ``((L - 1) // 2 + 1 - 2) // 2 + 1``, or the processor's own
  ``num_audio_tokens``), or ``None`` when the processor gives no way to know it (then the
  placeholder check is skipped, logged);
* outputs that only size the text expansion (a family's ``processor_only_keys``: Gemma 3's
  ``num_crops``, InternVL's ``num_patches``) are dropped: they are no model input;
* output keys carry the names the model's ``forward`` takes: an audio feature extractor's
  ``attention_mask`` becomes ``feature_attention_mask`` (it must never reach the model as
  the *text* attention mask), and a video gets ``video_second_per_grid`` (seconds per
  temporal grid: ``temporal_patch_size / fps``, the sampling rate of
  ``MediaItem.video()``, as Qwen2.5-Omni's processor computes it) when its processor does
  not give a timing key itself; :func:`forward_media_kwargs` renames or drops keys per model;
* audio is down-mixed to mono and resampled (PyAV) to the feature extractor's
  ``sampling_rate`` before feature extraction;
* :func:`process_decoded` is the one function that turns a *decoded* medium into tensors:
  the trainer's batches (:class:`MediaProcessor`) and the generator's forward
  (``HFGenerator``) both call it, so the tensors a generation saw are the tensors the
  trainer replays.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from gymbridge.errors import MediaDecodeError, MediaError
from gymbridge.families import (
    audio_output_length,
    family_of,
    num_placeholders,
    processor_only_keys,
    sub_processors,
)
from gymbridge.tensors.packed import derive_provenance

if TYPE_CHECKING:
    from gymbridge.media.cache import MediaCache

logger = logging.getLogger(__name__)

__all__ = [
    "MEDIA_KEY_CAST",
    "MEDIA_KEY_MODALITY",
    "MediaLike",
    "MediaProcessor",
    "ProcessedMedia",
    "ProcessorStats",
    "audio_output_length",
    "forward_media_kwargs",
    "mono_audio_at",
    "num_placeholders",
    "process_cached",
    "process_decoded",
    "sub_processors",
]

MEDIA_KEY_MODALITY: dict[str, str] = {
    "pixel_values": "image",
    "image_grid_thw": "image",
    "pixel_values_videos": "video",
    "video_grid_thw": "video",
    "video_second_per_grid": "video",
    "second_per_grid_ts": "video",
    "input_features": "audio",
    "feature_attention_mask": "audio",
    "audio_feature_lengths": "audio",
}
"""The modality of each model-input key gymbridge's processing produces (others: ``"other"``)."""

MEDIA_KEY_CAST: dict[str, bool] = {
    "pixel_values": True,
    "pixel_values_videos": True,
    "input_features": True,
    "image_grid_thw": False,
    "video_grid_thw": False,
    "video_second_per_grid": False,
    "second_per_grid_ts": False,
    "feature_attention_mask": False,
    "audio_feature_lengths": False,
}
"""Whether a media key is cast to the policy's dtype (``TrainBatch.cast_media``): the model's floating
inputs are; metadata never is, floating or not (``video_second_per_grid`` is float32 seconds: bf16
would round the timing the M-RoPE positions are computed from). A key not listed is not cast."""

_TEXT_KEYS = frozenset({"input_ids", "attention_mask", "position_ids", "token_type_ids", "mm_token_type_ids"})
"""Keys of the token stream: media outputs never carry them (the rollout's tokens are authoritative)."""

_TIMING_ALIASES: tuple[str, ...] = ("video_second_per_grid", "second_per_grid_ts")
"""Seconds per temporal video grid, as Qwen2.5-Omni and Qwen2.5-VL spell it."""


class MediaLike(Protocol):
    """What ``MediaProcessor`` needs of a media item (``gymbridge.media.MediaItem`` fits)."""

    @property
    def modality(self) -> str: ...

    @property
    def key(self) -> str: ...

    @property
    def source(self) -> str | None: ...

    def image(self) -> Any: ...

    def audio(self) -> Any: ...

    def video(self) -> Any: ...


@dataclass(frozen=True)
class ProcessedMedia:
    """The processor outputs of one content key: one tensor and one provenance id per output key."""

    modality: str
    content_key: str
    outputs: dict[str, torch.Tensor]
    provenance: dict[str, str]
    num_placeholders: int | None
    """Placeholder tokens the item occupies in the prompt, when the processor says."""


@dataclass
class ProcessorStats:
    """Counters: how many items were asked for vs actually processed."""

    items_requested: int = 0
    items_processed: int = 0
    per_modality: dict[str, int] = field(default_factory=dict)


def mono_audio_at(wave: Any, rate: int, target: int | None) -> Any:
    """``wave`` (``[N]`` or ``[N, C]`` float) as mono float32 ``[N']`` at ``target`` Hz (PyAV's resampler)."""
    import numpy as np

    mono = np.asarray(wave, dtype=np.float32)
    if mono.ndim == 2:
        mono = mono.mean(axis=1, dtype=np.float32)
    if target is None or int(target) == int(rate) or mono.size == 0:
        return np.ascontiguousarray(mono)
    import av

    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(mono[None, :]), format="flt", layout="mono")
    frame.sample_rate = int(rate)
    resampler = av.AudioResampler(format="flt", layout="mono", rate=int(target))
    chunks = [f.to_ndarray()[0] for f in [*resampler.resample(frame), *resampler.resample(None)]]
    return np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, dtype=np.float32)


def process_decoded(modality: str, sub: Any, decoded: Any) -> dict[str, torch.Tensor]:
    """Model-input tensors of one decoded medium through its sub-processor ``sub``.

    ``decoded`` is a PIL image, uint8 frames ``[T, H, W, 3]`` or ``(waveform, sample_rate)``
    (what ``MediaItem.image()`` / ``.video()`` / ``.audio()`` return). Returns the media
    tensors only, under the model's names (module docstring); raises what ``sub`` raises.
    """
    if modality == "image":
        feats = sub(images=[decoded], return_tensors="pt")
    elif modality == "video":
        feats = sub(videos=[decoded], return_tensors="pt")
    elif modality == "audio":
        wave, rate = decoded
        target = getattr(sub, "sampling_rate", None)
        feats = sub(
            mono_audio_at(wave, int(rate), target),
            sampling_rate=int(target or rate),
            return_tensors="pt",
            padding="max_length",
            return_attention_mask=True,
        )
    else:
        raise ValueError(f"unknown modality {modality!r}")
    dropped = processor_only_keys()
    outputs: dict[str, torch.Tensor] = {}
    for out_key, value in feats.items():
        if not isinstance(value, torch.Tensor) or out_key in dropped:
            continue
        if modality == "audio" and out_key == "attention_mask":
            out_key = "feature_attention_mask"  # the feature mask, never the text mask
        if out_key in _TEXT_KEYS:
            continue  # the rollout's tokens are authoritative
        outputs[out_key] = value.detach()
    if modality == "video" and "video_grid_thw" in outputs and not any(k in outputs for k in _TIMING_ALIASES):
        fps = float(getattr(sub, "fps", None) or 2.0)
        temporal = float(getattr(sub, "temporal_patch_size", 2) or 2)
        grids = outputs["video_grid_thw"].shape[0]
        outputs["video_second_per_grid"] = torch.full((grids,), temporal / fps, dtype=torch.float32)
    return outputs


def process_cached(
    cache: MediaCache, modality: str, sub: Any, key: str, decoded: Callable[[], Any]
) -> dict[str, torch.Tensor]:
    """:func:`process_decoded` of the medium ``key`` through ``cache`` (its ``processed:<modality>``
    entries): computed once per content key, ``decoded()`` called only on a miss."""
    return cache.get_or_make(f"processed:{modality}", key, lambda: process_decoded(modality, sub, decoded()))


def forward_media_kwargs(
    media: dict[str, torch.Tensor], forward_params: Iterable[str]
) -> dict[str, torch.Tensor]:
    """``media`` under the names a model's ``forward`` takes (``forward_params``).

    A timing key the model spells the other way (``second_per_grid_ts`` vs
    ``video_second_per_grid``) is renamed; a timing key the model does not take at all is
    dropped (Qwen2-VL has none). A media key that would replace a token-stream input
    (``input_ids``, ``attention_mask``, ...) raises ``ValueError``: a media mask must never
    overwrite the text attention mask.
    """
    params = set(forward_params)
    out: dict[str, torch.Tensor] = {}
    for key, value in media.items():
        if key in _TEXT_KEYS:
            raise ValueError(
                f"media key {key!r} would replace the token stream's {key}: media outputs must carry "
                "their own names (an audio feature mask is 'feature_attention_mask')"
            )
        if key in _TIMING_ALIASES and key not in params:
            other = next((a for a in _TIMING_ALIASES if a != key and a in params), None)
            if other is None:
                continue
            key = other
        out[key] = value
    return out


def _short_source(item: MediaLike) -> str:
    short = getattr(item, "short_source", None)
    if isinstance(short, str):
        return short
    source = item.source or "<unnamed>"
    return source if len(source) <= 80 else f"{source[:60]}…({len(source)} chars)"


def _config_of(sub: Any) -> str:
    cfg: Any
    try:
        cfg = sub.to_dict()
    except Exception:  # a processor without to_dict: fall back to its public attributes
        cfg = {k: v for k, v in vars(sub).items() if not k.startswith("_")}
    return json.dumps(cfg, sort_keys=True, default=str)


def _merge_size(sub: Any) -> int:
    return int(getattr(sub, "merge_size", 1) or 1)


class MediaProcessor:
    """Process media into model-input tensors once per content key (see the module docstring).

    ``processor`` is a Hugging Face processor (``processor.image_processor`` etc.) or a
    bare image processor. ``image_token_id`` / ``video_token_id`` / ``audio_token_id`` default
    to the token each item expands to, as the processor's family reads it
    (:meth:`~gymbridge.families.ModelFamily.processor_placeholder_ids`: ``processor.image_token_id``,
    or Gemma 3's soft image token); an item's placeholder count is the family's too
    (:meth:`~gymbridge.families.ModelFamily.num_placeholders`). ``name`` overrides the processor
    class name in the spec.
    """

    def __init__(
        self,
        processor: Any,
        *,
        name: str | None = None,
        image_token_id: int | None = None,
        video_token_id: int | None = None,
        audio_token_id: int | None = None,
    ) -> None:
        self.processor = processor
        self._subs = sub_processors(processor)
        if not self._subs:
            raise TypeError(f"{type(processor).__name__} has no image/video/audio sub-processor")
        base = name or f"{type(processor).__module__}.{type(processor).__qualname__}"
        self._spec: dict[str, str] = {}
        for modality, sub in self._subs.items():
            text = f"{base}|{modality}|{type(sub).__qualname__}|{_config_of(sub)}"
            self._spec[modality] = hashlib.sha256(text.encode()).hexdigest()[:24]
        self.family = family_of(processor)
        found = self.family.processor_placeholder_ids(processor)
        self.image_token_id = image_token_id if image_token_id is not None else found.get("image")
        self.video_token_id = video_token_id if video_token_id is not None else found.get("video")
        self.audio_token_id = audio_token_id if audio_token_id is not None else found.get("audio")
        tokenizer = getattr(processor, "tokenizer", None)
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        self.pad_token_id: int | None = int(pad) if isinstance(pad, int) else None
        self.stats = ProcessorStats()

    @property
    def modalities(self) -> tuple[str, ...]:
        return tuple(self._subs)

    def spec(self, modality: str) -> str:
        """Digest of the processor name and config used for ``modality`` (part of every provenance)."""
        return self._spec[modality]

    def placeholder_token_id(self, modality: str) -> int | None:
        return {"image": self.image_token_id, "video": self.video_token_id, "audio": self.audio_token_id}.get(
            modality
        )

    def merge_size(self, modality: str) -> int:
        return _merge_size(self._subs.get(modality))

    def sub_processor(self, modality: str) -> Any | None:
        """The processor that handles ``modality`` (``None`` when this processor has none)."""
        return self._subs.get(modality)

    def process(self, items: Sequence[MediaLike]) -> dict[str, ProcessedMedia]:
        """Process ``items``; returns content key -> outputs, each distinct key processed once."""
        out: dict[str, ProcessedMedia] = {}
        for item in items:
            self.stats.items_requested += 1
            key = item.key
            if key in out:
                if out[key].modality != item.modality:
                    raise MediaDecodeError(
                        f"content key {key[:12]} used as both {out[key].modality} and {item.modality}",
                        source=_short_source(item),
                    )
                continue
            out[key] = self._process_one(item)
        return out

    def _process_one(self, item: MediaLike) -> ProcessedMedia:
        modality = item.modality
        sub = self._subs.get(modality)
        if sub is None:
            raise MediaDecodeError(
                f"{type(self.processor).__name__} cannot process {modality} (it handles {list(self._subs)})",
                source=_short_source(item),
            )
        try:
            if modality == "image":
                decoded: Any = item.image()
            elif modality == "video":
                decoded = item.video()
            else:
                decoded = item.audio()
            outputs = process_decoded(modality, sub, decoded)
        except MediaError:
            raise
        except Exception as exc:
            raise MediaDecodeError(
                f"{type(sub).__name__} failed on a {modality}: {type(exc).__name__}: {exc}",
                source=_short_source(item),
            ) from exc
        if not outputs:
            raise MediaDecodeError(
                f"{type(sub).__name__} returned no tensors for a {modality}", source=_short_source(item)
            )
        spec = self._spec[modality]
        provenance = {
            k: derive_provenance(item.key, spec, k, str(v.dtype)) for k, v in sorted(outputs.items())
        }
        num = self.family.num_placeholders(modality, outputs, self.processor)
        self.stats.items_processed += 1
        self.stats.per_modality[modality] = self.stats.per_modality.get(modality, 0) + 1
        return ProcessedMedia(modality, item.key, outputs, provenance, num)
