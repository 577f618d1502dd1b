"""Model factories for the trainer: picklable callables that build a policy in any process.

Ray DP workers build their model copy from a factory (then load the driver's weights), so a
factory must be a module-level function or a ``functools.partial`` of one.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["from_config", "meta_from_config", "tiny_omni_policy", "tiny_policy"]


def tiny_policy(seed: int = 0) -> Any:
    """A private, trainable copy of the tiny offline Qwen2-VL (``build_tiny_vlm`` is cached and shared)."""
    from gymbridge.models.tiny_vlm import build_tiny_vlm

    return copy.deepcopy(build_tiny_vlm(seed).model)


def tiny_omni_policy(seed: int = 0) -> Any:
    """A private, trainable copy of the tiny offline Qwen2.5-Omni thinker (image, video and audio)."""
    from gymbridge.models.tiny_omni import build_tiny_omni

    return copy.deepcopy(build_tiny_omni(seed).model)


def from_config(model_class: type[Any], config: Any, *, device: str = "cpu") -> Any:
    """A fresh ``model_class(config)`` (random weights, to be overwritten by a state dict).

    ``functools.partial(from_config, type(model), model.config)`` is the cheap factory a DP
    worker needs: no tokenizer, no processor, nothing downloaded. ``device="meta"``: no storage
    and no random init at all (an FSDP worker shards it, then loads its own shard of the weights;
    buffers that are not in the state dict, such as rotary frequencies, must be copied in too).
    """
    import torch

    with torch.device(device):
        model = model_class(config)
    return model.eval()


def meta_from_config(model_class: type[Any], config: Any) -> Any:
    """``from_config`` on the meta device: the architecture without storage (see :func:`from_config`)."""
    return from_config(model_class, config, device="meta")
