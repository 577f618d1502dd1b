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
  (``prod(grid_thw) // merge_size**2`` for Qwen-style grids), or ``None`` when the
  processor gives no way to know it (then the placeholder check is skipped, logged).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from gymbridge.errors import MediaDecodeError, MediaError
from gymbridge.tensors.packed import derive_provenance

logger = logging.getLogger(__name__)

__all__ = ["MediaLike", "MediaProcessor", "ProcessedMedia", "ProcessorStats"]


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


_GRID_KEYS = {"image": "image_grid_thw", "video": "video_grid_thw"}


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


class MediaProcessor:
    """Process media into model-input tensors once per content key (see the module docstring).

    ``processor`` is a Hugging Face processor (``processor.image_processor`` etc.) or a
    bare image processor. ``image_token_id`` / ``video_token_id`` default to the
    processor's own (``processor.image_token_id``, or its ``image_token`` looked up in its
    tokenizer). ``name`` overrides the processor class name in the spec.
    """

    def __init__(
        self,
        processor: Any,
        *,
        name: str | None = None,
        image_token_id: int | None = None,
        video_token_id: int | None = None,
    ) -> None:
        self.processor = processor
        self._subs: dict[str, Any] = {}
        image_proc = getattr(processor, "image_processor", None)
        if image_proc is None and "pixel_values" in getattr(processor, "model_input_names", ()):
            image_proc = processor  # a bare image processor
        if image_proc is not None:
            self._subs["image"] = image_proc
        if (video_proc := getattr(processor, "video_processor", None)) is not None:
            self._subs["video"] = video_proc
        if (audio_proc := getattr(processor, "feature_extractor", None)) is not None:
            self._subs["audio"] = audio_proc
        if not self._subs:
            raise TypeError(f"{type(processor).__name__} has no image/video/audio sub-processor")
        base = name or f"{type(processor).__module__}.{type(processor).__qualname__}"
        self._spec: dict[str, str] = {}
        for modality, sub in self._subs.items():
            text = f"{base}|{modality}|{type(sub).__qualname__}|{_config_of(sub)}"
            self._spec[modality] = hashlib.sha256(text.encode()).hexdigest()[:24]
        self.image_token_id = (
            image_token_id if image_token_id is not None else self._token_id("image_token_id", "image_token")
        )
        self.video_token_id = (
            video_token_id if video_token_id is not None else self._token_id("video_token_id", "video_token")
        )
        tokenizer = getattr(processor, "tokenizer", None)
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        self.pad_token_id: int | None = int(pad) if isinstance(pad, int) else None
        self.stats = ProcessorStats()

    def _token_id(self, id_attr: str, token_attr: str) -> int | None:
        value = getattr(self.processor, id_attr, None)
        if isinstance(value, int):
            return value
        token = getattr(self.processor, token_attr, None)
        tokenizer = getattr(self.processor, "tokenizer", None)
        if isinstance(token, str) and tokenizer is not None:
            tid = tokenizer.convert_tokens_to_ids(token)
            return int(tid) if isinstance(tid, int) else None
        return None

    @property
    def modalities(self) -> tuple[str, ...]:
        return tuple(self._subs)

    def spec(self, modality: str) -> str:
        """Digest of the processor name and config used for ``modality`` (part of every provenance)."""
        return self._spec[modality]

    def placeholder_token_id(self, modality: str) -> int | None:
        return {"image": self.image_token_id, "video": self.video_token_id}.get(modality)

    def merge_size(self, modality: str) -> int:
        sub = self._subs.get(modality)
        return int(getattr(sub, "merge_size", 1) or 1)

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
                feats = sub(images=[item.image()], return_tensors="pt")
            elif modality == "video":
                feats = sub(videos=[item.video()], return_tensors="pt")
            else:
                wave, rate = item.audio()
                feats = sub(wave, sampling_rate=rate, return_tensors="pt")
        except MediaError:
            raise
        except Exception as exc:
            raise MediaDecodeError(
                f"{type(sub).__name__} failed on a {modality}: {type(exc).__name__}: {exc}",
                source=_short_source(item),
            ) from exc
        outputs: dict[str, torch.Tensor] = {}
        for out_key, value in feats.items():
            if out_key in ("input_ids", "attention_mask") and modality != "audio":
                continue  # the rollout's tokens are authoritative
            if isinstance(value, torch.Tensor):
                outputs[out_key] = value.detach()
        if not outputs:
            raise MediaDecodeError(
                f"{type(sub).__name__} returned no tensors for a {modality}", source=_short_source(item)
            )
        spec = self._spec[modality]
        provenance = {
            k: derive_provenance(item.key, spec, k, str(v.dtype)) for k, v in sorted(outputs.items())
        }
        grid_key = _GRID_KEYS.get(modality)
        num: int | None = None
        if grid_key is not None and grid_key in outputs:
            grid = outputs[grid_key].to(torch.int64)
            num = int(grid.prod(dim=-1).sum()) // (self.merge_size(modality) ** 2)
        self.stats.items_processed += 1
        self.stats.per_modality[modality] = self.stats.per_modality.get(modality, 0) + 1
        return ProcessedMedia(modality, item.key, outputs, provenance, num)
