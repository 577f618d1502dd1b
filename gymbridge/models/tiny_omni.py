"""A tiny, random-weight Qwen2.5-Omni *thinker* that sees images, video and audio: fully offline.

``build_tiny_omni(seed)`` returns a :class:`TinyOmni`: a
``Qwen2_5OmniThinkerForConditionalGeneration`` (text hidden 64, 2 layers; vision encoder
depth 2; audio encoder 1 layer over 16 mel bins), the tiny VLM's byte-level BPE tokenizer
trained in code with three audio special tokens added
(:data:`~gymbridge.models.tiny_vlm.OMNI_SPECIAL_TOKENS`),
the same chat template (images and videos between ``<|vision_start|>`` / ``<|vision_end|>``,
audio between ``<|audio_start|>`` / ``<|audio_end|>``), and a
:class:`~gymbridge.models.tiny_vlm.TinyVLMProcessor` with all three sub-processors.

**Why this model.** The thinker of Qwen2.5-Omni is the text-generating half of the omni model
the project targets: one forward takes ``pixel_values`` / ``image_grid_thw``,
``pixel_values_videos`` / ``video_grid_thw`` / ``video_second_per_grid`` and
``input_features`` / ``feature_attention_mask`` together, with M-RoPE positions over all three,
and it ships with this transformers version (5.24). Qwen3-Omni-MoE's thinker would need a MoE
text model and a larger audio encoder for the same coverage; Qwen2-Audio takes no images or
video; Phi-4-multimodal and Gemma-3n take no video. The talker / token2wav halves (speech out)
are not needed to train text generation and are not built.

**Processors.** Images: ``Qwen2VLImageProcessorPil``, the model's own image processor class
(no torchvision). Audio: ``WhisperFeatureExtractor``, the model's own feature extractor class
(16 mel bins, 4 s ``max_length`` padding, so every clip's features are ``[1, 16, 400]`` and
the masks say how much is real). Video: Qwen2-VL's video processor imports torchvision, which
must never be installed beside the CPU torch here, so :class:`TinyVideoProcessor` produces the
tensors the model's forward expects itself: frames resized to multiples of
``patch_size * merge_size``, normalised with the CLIP mean / std, padded to a multiple of the
temporal patch (2) by repeating the last frame, and flattened in Qwen2-VL's patch order
``[grid_t * grid_h * grid_w, C * temporal_patch * patch * patch]``.

Invariants:

* nothing is downloaded; the weights are drawn from ``torch.manual_seed(seed)`` with the
  global RNG restored afterwards;
* the config's special token ids (``image_token_id``, ``video_token_id``, ``audio_token_id``,
  vision / audio boundaries, eos) equal the tokenizer's;
* ``build_tiny_omni(seed)`` is cached per process and thread-safe, like ``build_tiny_vlm``
  (treat the result as read-only; ``copy.deepcopy(tiny.model)`` before training it).
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gymbridge.models.tiny_vlm import (
    AUDIO_END,
    AUDIO_PAD,
    AUDIO_START,
    END_OF_TEXT,
    IM_END,
    IM_START,
    IMAGE_PAD,
    OMNI_SPECIAL_TOKENS,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    TinyImageProcessor,
    TinyVLMProcessor,
    build_tiny_tokenizer,
    seeded_model,
    tiny_text_config,
)

logger = logging.getLogger(__name__)

__all__ = [
    "TINY_AUDIO_SECONDS",
    "TINY_VIDEO_MAX_PIXELS",
    "TinyOmni",
    "TinyVideoProcessor",
    "build_tiny_omni",
]

TINY_AUDIO_SECONDS = 4
"""Audio features are padded to this many seconds (longer clips are cut there by the extractor)."""
TINY_VIDEO_MAX_PIXELS = 56 * 56
"""Largest resized frame area: a 64x64 frame becomes 56x56 -> 4 merged tokens per temporal patch."""
_VIDEO_MIN_PIXELS = 28 * 28
_MEL_BINS = 16
_PATCH = 14
_MERGE = 2
_TEMPORAL = 2
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class TinyVideoProcessor:
    """Frames ``[T, H, W, 3]`` uint8 -> ``pixel_values_videos`` and ``video_grid_thw`` (module docstring).

    ``fps`` is the frame rate the frames were sampled at (``MediaPolicy.video_fps``, default 2):
    :func:`~gymbridge.tensors.processor.process_decoded` derives ``video_second_per_grid``
    (``temporal_patch_size / fps``) from it, as Qwen2.5-Omni's processor does.
    """

    model_input_names = ("pixel_values_videos", "video_grid_thw")

    def __init__(
        self,
        *,
        min_pixels: int = _VIDEO_MIN_PIXELS,
        max_pixels: int = TINY_VIDEO_MAX_PIXELS,
        fps: float = 2.0,
    ) -> None:
        self.patch_size = _PATCH
        self.merge_size = _MERGE
        self.temporal_patch_size = _TEMPORAL
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels
        self.fps = fps

    def to_dict(self) -> dict[str, Any]:
        return {
            "patch_size": self.patch_size,
            "merge_size": self.merge_size,
            "temporal_patch_size": self.temporal_patch_size,
            "min_pixels": self.min_pixels,
            "max_pixels": self.max_pixels,
            "fps": self.fps,
        }

    def _one(self, frames: Any) -> tuple[torch.Tensor, torch.Tensor]:
        from PIL import Image
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        video = np.asarray(frames)
        if video.ndim != 4 or video.shape[-1] != 3 or video.shape[0] == 0:
            raise ValueError(f"a video must be uint8 frames [T, H, W, 3], got shape {video.shape}")
        t, h, w, _ = video.shape
        factor = self.patch_size * self.merge_size
        rh, rw = smart_resize(h, w, factor=factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        resized = np.stack(
            [np.asarray(Image.fromarray(f).resize((rw, rh), Image.Resampling.BICUBIC)) for f in video]
        ).astype(np.float32)
        mean = np.asarray(_CLIP_MEAN, dtype=np.float32)
        std = np.asarray(_CLIP_STD, dtype=np.float32)
        normed = ((resized / 255.0 - mean) / std).transpose(0, 3, 1, 2)  # [T, C, H, W]
        if t % self.temporal_patch_size:
            pad = self.temporal_patch_size - t % self.temporal_patch_size
            normed = np.concatenate([normed, np.repeat(normed[-1:], pad, axis=0)])
        tp, p, m = self.temporal_patch_size, self.patch_size, self.merge_size
        grid_t, grid_h, grid_w = normed.shape[0] // tp, rh // p, rw // p
        patches = normed.reshape(grid_t, tp, 3, grid_h // m, m, p, grid_w // m, m, p)
        patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        flat = patches.reshape(grid_t * grid_h * grid_w, 3 * tp * p * p)
        return torch.from_numpy(np.ascontiguousarray(flat)), torch.tensor([[grid_t, grid_h, grid_w]])

    def __call__(
        self, videos: Any, return_tensors: str | None = "pt", return_metadata: bool = False, **kwargs: Any
    ) -> Any:
        """``return_metadata``: also ``video_metadata``, one ``VideoMetadata`` per video (its frames were
        sampled at :attr:`fps`: every frame kept), what a transformers processor reads its timing from."""
        from transformers import BatchFeature

        videos = list(videos)
        done = [self._one(v) for v in videos]
        data: dict[str, Any] = {
            "pixel_values_videos": torch.cat([d[0] for d in done]),
            "video_grid_thw": torch.cat([d[1] for d in done]),
        }
        if return_metadata:
            from transformers.video_utils import VideoMetadata

            data["video_metadata"] = [
                VideoMetadata(total_num_frames=len(v), fps=self.fps, frames_indices=list(range(len(v))))
                for v in videos
            ]
        return BatchFeature(data=data, tensor_type=None)


def tiny_feature_extractor() -> Any:
    """The tiny model's audio feature extractor: ``WhisperFeatureExtractor`` at 16 kHz, 16 mel bins."""
    from transformers import WhisperFeatureExtractor

    extractor: Any = WhisperFeatureExtractor
    return extractor(
        feature_size=_MEL_BINS,
        sampling_rate=16000,
        hop_length=160,
        chunk_length=TINY_AUDIO_SECONDS,
        n_fft=400,
    )


@dataclass(frozen=True)
class TinyOmni:
    """The tiny omni model, its processor and tokenizer, and the special token ids."""

    model: Any
    """``Qwen2_5OmniThinkerForConditionalGeneration`` in eval mode, fp32, CPU, random weights."""
    processor: TinyVLMProcessor
    tokenizer: Any
    seed: int
    image_token_id: int
    video_token_id: int
    audio_token_id: int
    eos_token_id: int
    pad_token_id: int

    @property
    def placeholder_token_ids(self) -> tuple[int, int, int]:
        """Image, video and audio placeholder ids (a rollout must never generate them)."""
        return (self.image_token_id, self.video_token_id, self.audio_token_id)


_BUILD_LOCK = threading.Lock()


def build_tiny_omni(seed: int = 0) -> TinyOmni:
    """Build (once per process and seed) the tiny offline Qwen2.5-Omni thinker; see the module docstring."""
    with _BUILD_LOCK:
        return _build_tiny_omni(seed)


@functools.cache
def _build_tiny_omni(seed: int) -> TinyOmni:
    from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration

    tokenizer = build_tiny_tokenizer(OMNI_SPECIAL_TOKENS)

    def tid(name: str) -> int:
        return int(tokenizer.convert_tokens_to_ids(name))

    hidden = int(tiny_text_config(0, 0)["hidden_size"])
    eos, pad = tid(IM_END), tid(END_OF_TEXT)
    vision_ids: dict[str, Any] = {
        "vision_start_token_id": tid(VISION_START),
        "vision_end_token_id": tid(VISION_END),
    }
    config = Qwen2_5OmniThinkerConfig(
        audio_config={
            "num_mel_bins": _MEL_BINS,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 64,
            "d_model": 32,
            "output_dim": hidden,
            "n_window": 50,
            "max_source_positions": 100 * TINY_AUDIO_SECONDS,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": hidden,
            "fullatt_block_indexes": [1],
            "window_size": _PATCH * _MERGE * 2,
            "patch_size": _PATCH,
            "spatial_merge_size": _MERGE,
            "temporal_patch_size": _TEMPORAL,
        },
        text_config=tiny_text_config(pad, eos),
        image_token_index=tid(IMAGE_PAD),
        video_token_index=tid(VIDEO_PAD),
        audio_token_index=tid(AUDIO_PAD),
        # not declared fields of the thinker config, but read by its M-RoPE index (extra attributes)
        **vision_ids,
        audio_start_token_id=tid(AUDIO_START),
        audio_end_token_id=tid(AUDIO_END),
        user_token_id=tid(IM_START),
    )
    model = seeded_model(Qwen2_5OmniThinkerForConditionalGeneration, config, seed, eos=eos, pad=pad)
    processor = TinyVLMProcessor(
        tokenizer, TinyImageProcessor.build(), TinyVideoProcessor(), tiny_feature_extractor()
    )
    logger.debug(
        "built tiny Qwen2.5-Omni thinker (seed=%d, %d parameters)",
        seed,
        sum(p.numel() for p in model.parameters()),
    )
    return TinyOmni(
        model=model,
        processor=processor,
        tokenizer=tokenizer,
        seed=seed,
        image_token_id=tid(IMAGE_PAD),
        video_token_id=tid(VIDEO_PAD),
        audio_token_id=tid(AUDIO_PAD),
        eos_token_id=eos,
        pad_token_id=pad,
    )
