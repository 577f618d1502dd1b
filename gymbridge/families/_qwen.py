"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL and the Qwen2.5-Omni thinker.

Their rules are the generic ones (:class:`~gymbridge.families._base.ModelFamily`): a template
writes ``<|vision_start|><|image_pad|><|vision_end|>``, the processor repeats ``<|image_pad|>``
``prod(grid_thw) // merge**2`` times, the forward takes ``mm_token_type_ids`` (0 text, 1 image,
2 video) for its M-RoPE index (``get_rope_index``: 3-D positions; Qwen3-VL's interleaved, with
each video frame's grid on its own), and the encoders take their grid. Qwen2.5-VL spells the
video timing ``second_per_grid_ts``, the omni thinker ``video_second_per_grid``
(:func:`~gymbridge.tensors.processor.forward_media_kwargs` renames); Qwen3-VL's encoder also
returns DeepStack features per item, which the encoder path carries like the pooled ones. The
omni thinker computes audio inside its forward from ``input_features`` and reads audio
placeholders from ``inputs_embeds``, so audio is encoded once per item there too.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

from gymbridge.families._base import ModelFamily

__all__ = ["QwenOmni", "QwenVL"]


class QwenVL(ModelFamily):
    """Qwen2-VL, Qwen2.5-VL, Qwen3-VL (and Qwen3-VL-MoE)."""

    name: ClassVar[str] = "qwen_vl"
    model_types: ClassVar[frozenset[str]] = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"})
    processor_classes: ClassVar[frozenset[str]] = frozenset(
        {"TinyVLMProcessor", "Qwen2VLProcessor", "Qwen2_5_VLProcessor", "Qwen3VLProcessor"}
    )
    end_of_turn: ClassVar[str | None] = "<|im_end|>"
    positions: ClassVar[str] = "M-RoPE (get_rope_index)"


class QwenOmni(QwenVL):
    """The Qwen2.5-Omni thinker: images, video and audio (``qwen2_5_omni``: the whole checkpoint, as
    vLLM serves it; its token ids are on the ``thinker_config``)."""

    name: ClassVar[str] = "qwen2_5_omni"
    model_types: ClassVar[frozenset[str]] = frozenset({"qwen2_5_omni_thinker", "qwen2_5_omni"})
    processor_classes: ClassVar[frozenset[str]] = frozenset({"Qwen2_5OmniProcessor"})

    def encoder_reason(self, model: Any, modality: str) -> str | None:
        if modality != "audio":
            return super().encoder_reason(model, modality)
        if not callable(getattr(model, "get_audio_features", None)):
            return f"{type(model).__name__} has no get_audio_features"
        params = set(inspect.signature(model.forward).parameters)
        if "inputs_embeds" not in params or not callable(getattr(model, "get_input_embeddings", None)):
            return f"{type(model).__name__}.forward takes no inputs_embeds"
        if getattr(model.config, "audio_token_id", None) is None:
            return f"{type(model).__name__}'s config names no audio_token_id"
        return None
