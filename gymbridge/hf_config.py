"""Reading a Hugging Face model config by its attributes alone (no transformers import).

A VLM keeps its token ids on its top config, on a ``text_config``, or (a whole Qwen2.5-Omni
checkpoint, as vLLM serves it) on a ``thinker_config`` and its own ``text_config``.
:func:`model_sub_configs` lists them in that order; the family adapters (:mod:`gymbridge.families`)
and the generators (:mod:`gymbridge.generation`) both read ids through it.

Invariant: pure; the config is never changed, and anything with attributes is a config.
"""

from __future__ import annotations

from typing import Any

__all__ = ["model_sub_configs"]


def model_sub_configs(config: Any) -> list[Any]:
    """``config`` and the sub-configs that carry a VLM's token ids: its ``text_config``, and a
    ``thinker_config`` with its own ``text_config`` (a whole Qwen2.5-Omni checkpoint, as vLLM
    serves it, keeps its placeholder ids on the thinker's config)."""
    out: list[Any] = []
    for cfg in (config, getattr(config, "thinker_config", None)):
        if cfg is None:
            continue
        out.append(cfg)
        text = getattr(cfg, "text_config", None)
        if text is not None:
            out.append(text)
    return out
