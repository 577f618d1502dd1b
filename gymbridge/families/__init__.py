"""Per-family model adapters: every model-dependent rule of gymbridge, one class per VLM family.

A VLM family decides how media enter the token stream and the forward: which token an item
expands to and how many of them (placeholder expansion, the per-turn placeholder-vs-media check),
which processor outputs are model inputs, which per-token inputs the forward needs besides the
media (Qwen's ``mm_token_type_ids`` for M-RoPE, Gemma 3's ``token_type_ids`` for bidirectional
image attention), how its encoder is called and how its outputs are laid out (the trainer's
once-per-item encoding), what a packed sequence's attention mask must be, the chat template's
end-of-turn marker, and the prompt vLLM's processor expects (one placeholder per item).
gymbridge's generic code asks :func:`family_of` for the family and calls its methods; it holds
no family's rules itself.

=============  ==================================================  ========================
family         model types                                         positions
=============  ==================================================  ========================
``qwen_vl``    qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe        M-RoPE (get_rope_index)
``qwen2_5_omni``  qwen2_5_omni_thinker, qwen2_5_omni (audio once)  M-RoPE
``gemma3``     gemma3                                              1-D, bidirectional images
``internvl``   internvl                                            1-D
=============  ==================================================  ========================

A model or processor of no registered family gets :data:`GENERIC` (the rules a grid-based VLM
follows: config placeholder ids, ``*_grid_thw`` counts). :func:`register_family` adds one;
docs/models.md says how to write it.

Invariant: lookups are pure (by ``config.model_type`` / processor class name); a family's methods
never change the objects they are given.
"""

from __future__ import annotations

from typing import Any

from gymbridge.families._base import (
    GENERIC,
    MODALITIES,
    ModelFamily,
    audio_output_length,
    collapse_runs,
    num_placeholders,
    sub_processors,
)
from gymbridge.families._gemma3 import Gemma3
from gymbridge.families._internvl import InternVL
from gymbridge.families._processors import image_only_processor, load_image_only_processor
from gymbridge.families._qwen import QwenOmni, QwenVL

__all__ = [
    "GENERIC",
    "MODALITIES",
    "Gemma3",
    "InternVL",
    "ModelFamily",
    "QwenOmni",
    "QwenVL",
    "audio_output_length",
    "collapse_runs",
    "end_of_turn_markers",
    "families",
    "family_of",
    "image_only_processor",
    "load_image_only_processor",
    "num_placeholders",
    "processor_only_keys",
    "register_family",
    "sub_processors",
]

_FAMILIES: list[ModelFamily] = [QwenVL(), QwenOmni(), Gemma3(), InternVL()]


def register_family(family: ModelFamily) -> None:
    """Add ``family`` (it takes precedence over registered families for its model types and processors)."""
    _FAMILIES.insert(0, family)


def families() -> tuple[ModelFamily, ...]:
    """The registered families, most recently registered first."""
    return tuple(_FAMILIES)


def _model_type(obj: Any) -> str | None:
    config = getattr(obj, "config", obj)
    value = getattr(config, "model_type", None)
    return value if isinstance(value, str) else None


def family_of(obj: Any) -> ModelFamily:
    """The family of a model, a model config or a processor (:data:`GENERIC` when none claims it).

    A model or config is matched by ``model_type``; a processor (or bare tokenizer) by the class
    names along its MRO, so a subclass of ``Qwen3VLProcessor`` is Qwen's.
    """
    model_type = _model_type(obj)
    if model_type is not None:
        for family in _FAMILIES:
            if model_type in family.model_types:
                return family
        return GENERIC
    names = {cls.__name__ for cls in type(obj).__mro__}
    for family in _FAMILIES:
        if names & family.processor_classes:
            return family
    return GENERIC


def end_of_turn_markers() -> tuple[str, ...]:
    """Every registered family's end-of-turn marker (a chat template's own, not the eos token)."""
    seen: dict[str, None] = {}
    for family in _FAMILIES:
        if family.end_of_turn is not None:
            seen.setdefault(family.end_of_turn, None)
    return tuple(seen)


def processor_only_keys() -> frozenset[str]:
    """Processor outputs of any registered family that size the text and are no model input."""
    out: set[str] = set()
    for family in _FAMILIES:
        out |= family.processor_only_keys
    return frozenset(out)
