"""The run's model: the trainer's policy, its processor, and how the generator builds its own copy.

``model.name`` is one of :data:`TINY_MODELS` (random weights from a small config of the real
architecture, offline, in milliseconds) or a local Hugging Face model directory, loaded with
:meth:`~gymbridge.generation.hf.HFGenerator.from_pretrained` (``local_files_only``; never from a
hub, never remote code). ``tiny`` picks the Qwen2.5-Omni thinker when the environment takes
audio or video, else the Qwen2-VL.

Invariant: the generator never holds the trainer's model object: :attr:`RunModel.policy_factory`
builds it a copy of its own, so an optimizer step never changes weights under a running generation.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gymbridge.errors import ConfigError

__all__ = ["TINY_MODELS", "RunModel", "load_pretrained", "pick_model", "require_vllm"]

TINY_MODELS = ("tiny", "tiny-qwen2-vl", "tiny-qwen2.5-omni")
"""``model.name`` values naming the offline tiny models (``tiny``: by the environment's modalities)."""


@dataclass(frozen=True)
class RunModel:
    """The run's model: processor and tokenizer, the trainable policy, and its placeholder ids."""

    name: str
    processor: Any
    tokenizer: Any
    policy: Any
    placeholder_token_ids: tuple[int, ...]
    policy_factory: Callable[[int], Any]
    """Builds this model's policy from a seed (the in-process generator's own copy)."""
    serve_flag: str | tuple[str, ...]
    """The ``gymbridge model serve`` flag(s) that serve this model (``generator.placement: process``)."""
    tiny: bool = True
    """Random weights built offline (else a model directory's weights)."""


def pick_model(name: str, seed: int, modalities: tuple[str, ...], backend: str = "hf") -> RunModel:
    """The model ``name`` (module docstring); ``modalities`` are the environment's (``tiny``'s choice)."""
    if name not in TINY_MODELS:
        return load_pretrained(name, backend)
    if name == "tiny":
        name = "tiny-qwen2.5-omni" if {"video", "audio"} & set(modalities) else "tiny-qwen2-vl"
    from gymbridge.trainer.models import tiny_omni_policy, tiny_policy

    if name == "tiny-qwen2.5-omni":
        from gymbridge.testing.tiny_omni import build_tiny_omni

        omni = build_tiny_omni(seed)
        return RunModel(
            f"gymbridge-tiny-qwen2.5-omni-seed{seed}",
            omni.processor,
            omni.tokenizer,
            tiny_omni_policy(seed),
            omni.placeholder_token_ids,
            tiny_omni_policy,
            "--tiny-omni",
        )
    from gymbridge.testing.tiny_vlm import build_tiny_vlm

    vlm = build_tiny_vlm(seed)
    return RunModel(
        f"gymbridge-tiny-qwen2-vl-seed{seed}",
        vlm.processor,
        vlm.tokenizer,
        tiny_policy(seed),
        (vlm.image_token_id, vlm.video_token_id),
        tiny_policy,
        "--tiny",
    )


_PLACEHOLDER_ATTRS = (
    "image_token_id",
    "video_token_id",
    "audio_token_id",
    "image_token_index",
    "video_token_index",
    "audio_token_index",
)


def load_pretrained(path: str, backend: str = "hf") -> RunModel:
    """Load the model directory ``path`` (module docstring); a bad path is a :class:`ConfigError`."""
    from gymbridge.generation.cli import check_model_dir
    from gymbridge.generation.hf import HFGenerator

    check_model_dir(path)
    loaded = HFGenerator.from_pretrained(path)
    config = loaded.model.config
    ids = {int(v) for a in _PLACEHOLDER_ATTRS if isinstance(v := getattr(config, a, None), int)}

    def build(seed: int) -> Any:  # the weights are the directory's: the seed does not change them
        return HFGenerator.from_pretrained(path).model

    tokenizer = getattr(loaded.processor, "tokenizer", loaded.processor)
    serve = ("--model", str(path), "--backend", backend)
    policy = loaded.model.train()
    return RunModel(
        str(path), loaded.processor, tokenizer, policy, tuple(sorted(ids)), build, serve, tiny=False
    )


def require_vllm() -> None:
    """``model.backend: vllm`` needs vLLM (GPU machines): a :class:`ConfigError` naming the extra."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            [
                "model.backend=vllm needs vLLM, which is not installed: pip install 'gymbridge[vllm]' "
                "(GPU machines only); or use model.backend=hf"
            ]
        )
