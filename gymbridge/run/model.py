"""The run's model: the trainer's policy, its processor, and how the generator builds its own copy.

``model.name`` is a tiny model (random weights from a small config of the real architecture,
offline, in seconds): ``tiny:FAMILY`` for each family of
:data:`~gymbridge.models.tiny_families.TINY_FAMILIES` (docs/models.md), or one of :data:`TINY_MODELS`
(``tiny-qwen2-vl`` = ``tiny:qwen2_vl``, ``tiny-qwen2.5-omni`` = ``tiny:qwen2_5_omni``; ``tiny``
picks the Qwen2.5-Omni thinker when the environment takes audio or video, else ``tiny:qwen2_vl``);
or a local Hugging Face model directory, loaded with
:meth:`~gymbridge.generation.hf.HFGenerator.from_pretrained` (``local_files_only``; never from a
hub, never remote code).

Invariant: the generator never holds the trainer's model object: :attr:`RunModel.policy_factory`
builds it a copy of its own, so an optimizer step never changes weights under a running generation.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gymbridge.errors import ConfigError

__all__ = [
    "TINY_ALIASES",
    "TINY_MODELS",
    "RunModel",
    "is_tiny_name",
    "load_pretrained",
    "pick_model",
    "require_vllm",
    "tiny_family_of",
]

TINY_MODELS = ("tiny", "tiny-qwen2-vl", "tiny-qwen2.5-omni")
"""``model.name`` values naming the offline tiny models (``tiny``: by the environment's modalities);
every ``tiny:FAMILY`` names one too."""

TINY_ALIASES: dict[str, str] = {"tiny-qwen2-vl": "qwen2_vl", "tiny-qwen2.5-omni": "qwen2_5_omni"}
"""The older tiny model names -> the family each is (the same model as ``tiny:FAMILY``)."""


def is_tiny_name(name: str) -> bool:
    """``name`` names a tiny model (:data:`TINY_MODELS` or ``tiny:FAMILY``), not a model directory."""
    return name in TINY_MODELS or name.startswith("tiny:")


def tiny_family_of(name: str, modalities: tuple[str, ...] = ()) -> str | None:
    """The tiny family ``name`` builds (``None``: a model directory); ``tiny`` goes by ``modalities``.

    An unknown ``tiny:FAMILY`` is a :class:`ConfigError` listing the families.
    """
    from gymbridge.models.tiny_families import parse_tiny_spec

    if name == "tiny":
        return "qwen2_5_omni" if {"video", "audio"} & set(modalities) else "qwen2_vl"
    return TINY_ALIASES.get(name) or parse_tiny_spec(name)


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
    family = tiny_family_of(name, modalities)
    if family is None:
        return load_pretrained(name, backend)
    if family not in TINY_ALIASES.values():
        return _tiny_family_model(family, seed)
    from gymbridge.trainer.models import tiny_omni_policy, tiny_policy

    if family == "qwen2_5_omni":
        from gymbridge.models.tiny_omni import build_tiny_omni

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
    from gymbridge.models.tiny_vlm import build_tiny_vlm

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


def _tiny_family_model(family: str, seed: int) -> RunModel:
    """The tiny model of ``family``: a private trainable copy of it, every placeholder id it has
    (a rollout must never generate one), a picklable policy factory, and the
    ``gymbridge model serve --model tiny:FAMILY`` flags of the same model (``placement: process``)."""
    from gymbridge.models.tiny_families import TINY_PREFIX, tiny_family_policy, tiny_model

    tiny = tiny_model(family, seed)
    return RunModel(
        tiny.name,
        tiny.processor,
        tiny.tokenizer,
        tiny_family_policy(family, seed),
        tuple(sorted(set(tiny.placeholder_token_ids.values()))),
        functools.partial(tiny_family_policy, family),
        ("--model", f"{TINY_PREFIX}{family}"),
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
