"""Where the families' models keep their media encoders: the vision and audio towers that
:func:`gymbridge.trainer.memory.freeze_encoders` freezes and LoRA (:mod:`gymbridge.generation.lora`)
leaves out of its targets."""

from __future__ import annotations

from typing import Any

__all__ = ["ENCODER_NAMES", "encoder_modules"]

ENCODER_NAMES: tuple[str, ...] = ("visual", "vision_tower", "vision_model", "audio_tower", "audio_model")
"""Attribute names of media encoders in the families' models (Qwen2-VL's ``model.visual``, the Omni
thinker's ``visual`` and ``audio_tower``, Gemma 3's and InternVL's ``vision_tower``)."""


def encoder_modules(model: Any) -> list[tuple[str, Any]]:
    """The outermost submodules of ``model`` named one of :data:`ENCODER_NAMES`, with their names."""
    found: list[tuple[str, Any]] = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in ENCODER_NAMES:
            continue
        if any(name.startswith(f"{outer}.") for outer, _ in found):
            continue
        found.append((name, module))
    return found
