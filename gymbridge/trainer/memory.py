"""Memory where it matters: one function per technique, each applied to a plain ``nn.Module``
before the trainer (or ``fully_shard``) sees it, each switched by a :class:`~gymbridge.trainer.GRPOConfig`
field (docs/memory.md).

* :func:`apply_activation_checkpointing` (``activation_checkpointing``): every block (a module whose
  class is in the model's ``_no_split_modules`` and that sits in a ``ModuleList``: decoder layers,
  vision and audio encoder layers) keeps only its inputs for the backward and runs its forward
  again there (``torch.utils.checkpoint``, non-reentrant). The block's class is swapped for a
  subclass, as FSDP2's ``fully_shard`` does, so parameter names and ``state_dict`` keys do not change
  (``checkpoint_wrapper`` would add ``_checkpoint_wrapped_module.`` to ``named_parameters``);
  transformers' own ``gradient_checkpointing_enable`` checkpoints only in training mode, and the
  trainer runs the policy in eval mode;
* :func:`freeze_encoders` (``freeze_vision_tower``): the vision and audio encoders' parameters get
  ``requires_grad=False``; the trainer optimizes only parameters that require a gradient;
* :func:`enable_autocast` (``dtype: bfloat16``): parameters and AdamW stay fp32 (the master weights)
  and :func:`~gymbridge.trainer.forward.scored_logprobs` runs the forward under
  ``torch.autocast(dtype=...)``: an update of ``lr * ~1`` on a bf16 weight of ``|w| > 2**8 * lr``
  rounds to nothing, on its fp32 master it does not.

:func:`prepare_policy` applies all three from a config, in that order. Invariants: each function is
idempotent, leaves the model's outputs and gradients as they were (checkpointing recomputes the
same values; freezing only drops gradients) and changes no parameter's name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.checkpoint import checkpoint

from gymbridge.families.encoders import ENCODER_NAMES, encoder_modules

if TYPE_CHECKING:
    from gymbridge.trainer.grpo import GRPOConfig

logger = logging.getLogger(__name__)

__all__ = [
    "ENCODER_NAMES",
    "PolicyMemory",
    "apply_activation_checkpointing",
    "autocast_dtype",
    "checkpointed_blocks",
    "enable_autocast",
    "freeze_encoders",
    "prepare_policy",
    "trainable_parameters",
]

_AUTOCAST_ATTR = "gymbridge_autocast_dtype"
"""The model attribute :func:`enable_autocast` sets (copied by ``copy.deepcopy`` with the model)."""


class _Checkpointed:
    """Marker base of the swapped block classes (:func:`apply_activation_checkpointing`)."""


_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")
"""Keyword arguments by which the families' blocks receive a KV cache."""

_CHECKPOINTED: dict[type[torch.nn.Module], type[torch.nn.Module]] = {}


def _checkpointed_class(cls: type[torch.nn.Module]) -> type[torch.nn.Module]:
    """``cls`` whose forward runs under ``torch.utils.checkpoint`` whenever a gradient is being taken
    (one subclass per class, made once)."""
    made = _CHECKPOINTED.get(cls)
    if made is not None:
        return made
    inner = cls.forward

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # the reference, generation: nothing to replay
            return inner(self, *args, **kwargs)
        # the replay in the backward must not append to a KV cache a second time (transformers'
        # own checkpointing drops it the same way)
        for name in _CACHE_KWARGS:
            if kwargs.get(name) is not None:
                kwargs[name] = None
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        return checkpoint(inner, self, *args, use_reentrant=False, **kwargs)

    made = type(
        f"Checkpointed{cls.__name__}",
        (_Checkpointed, cls),
        {"forward": forward, "__module__": cls.__module__, "__qualname__": f"Checkpointed{cls.__qualname__}"},
    )
    return _CHECKPOINTED.setdefault(cls, made)


def checkpointed_blocks(model: torch.nn.Module) -> list[str]:
    """Names of ``model``'s blocks: modules of a ``_no_split_modules`` class inside a ``ModuleList``."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    names: list[str] = []
    for parent_name, parent in model.named_modules():
        if not isinstance(parent, torch.nn.ModuleList):
            continue
        for index, child in enumerate(parent):
            base = type(child).__mro__[2] if isinstance(child, _Checkpointed) else type(child)
            if base.__name__ in classes:
                names.append(f"{parent_name}.{index}" if parent_name else str(index))
    return names


def apply_activation_checkpointing(model: torch.nn.Module) -> int:
    """Checkpoint every block of ``model`` (module docstring); returns how many blocks are checkpointed.

    Works on a plain module (before ``fully_shard``); parameter names and ``state_dict`` keys are
    unchanged; calling it again changes nothing. A model with no block (no ``_no_split_modules``
    class in a ``ModuleList``) raises ``ValueError`` naming its class.
    """
    names = checkpointed_blocks(model)
    if not names:
        raise ValueError(
            f"activation_checkpointing: {type(model).__name__} has no block to checkpoint (no module of its "
            f"_no_split_modules {sorted(getattr(model, '_no_split_modules', None) or ())} in a ModuleList)"
        )
    for name in names:
        block = model.get_submodule(name)
        if not isinstance(block, _Checkpointed):
            block.__class__ = _checkpointed_class(type(block))
    return len(names)


def freeze_encoders(model: torch.nn.Module) -> int:
    """``requires_grad=False`` on every parameter of ``model``'s vision and audio encoders; returns how
    many parameter tensors that froze (0 when called again).

    The encoders are the outermost submodules named one of :data:`ENCODER_NAMES`: with them go what
    the family keeps inside the encoder (Qwen's patch merger); projections outside it (Gemma 3's and
    InternVL's ``multi_modal_projector``) stay trainable. A model without an encoder raises
    ``ValueError`` naming its class.
    """
    encoders = encoder_modules(model)
    if not encoders:
        raise ValueError(
            f"freeze_vision_tower: {type(model).__name__} has no vision or audio encoder (no submodule "
            f"named {', '.join(ENCODER_NAMES)})"
        )
    frozen = 0
    for _, encoder in encoders:
        for p in encoder.parameters():
            if p.requires_grad:
                p.requires_grad_(False)
                frozen += 1
    logger.debug("froze %d parameter tensors in %s", frozen, ", ".join(n for n, _ in encoders))
    return frozen


def enable_autocast(model: torch.nn.Module, dtype: torch.dtype | None) -> None:
    """Run ``model``'s trainer forward passes under ``torch.autocast(dtype=dtype)`` (``None``: not).

    The parameters keep their dtype (fp32 masters); :func:`~gymbridge.trainer.forward.scored_logprobs`
    reads the setting (:func:`autocast_dtype`). A copy of the model (the KL reference) keeps it.
    """
    setattr(model, _AUTOCAST_ATTR, dtype)


def autocast_dtype(model: Any) -> torch.dtype | None:
    """The dtype :func:`enable_autocast` set on ``model`` (``None``: no autocast)."""
    dtype = getattr(model, _AUTOCAST_ATTR, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def trainable_parameters(model: torch.nn.Module) -> int:
    """Elements of ``model``'s parameters that require a gradient."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@dataclass(frozen=True)
class PolicyMemory:
    """What :func:`prepare_policy` did to a policy."""

    checkpointed_blocks: int
    frozen_tensors: int
    trainable_params: int
    """Parameter elements the optimizer updates."""
    total_params: int
    autocast: torch.dtype | None

    def describe(self) -> str:
        """One line for the run's setup messages."""
        frozen = f" (encoders frozen: {self.frozen_tensors} tensors)" if self.frozen_tensors else ""
        parts = [f"trainable params {self.trainable_params:,} of {self.total_params:,}{frozen}"]
        parts.append(
            f"activation checkpointing on {self.checkpointed_blocks} blocks"
            if self.checkpointed_blocks
            else "activation checkpointing off"
        )
        if self.autocast is not None:
            parts.append(f"{str(self.autocast).removeprefix('torch.')} autocast over fp32 master weights")
        return "memory: " + ", ".join(parts)


def prepare_policy(model: torch.nn.Module, config: GRPOConfig, *, masters: bool = True) -> PolicyMemory:
    """Apply ``config``'s memory settings to ``model`` in place, before a trainer is built on it.

    ``freeze_vision_tower`` -> :func:`freeze_encoders`; ``activation_checkpointing`` ->
    :func:`apply_activation_checkpointing`; with ``masters`` and a ``dtype`` other than float32, the
    model is cast to float32 and :func:`enable_autocast` set to ``dtype`` (without ``masters`` the
    caller casts the model itself, as before: no master copy).
    """
    frozen = freeze_encoders(model) if config.freeze_vision_tower else 0
    blocks = apply_activation_checkpointing(model) if config.activation_checkpointing else 0
    autocast: torch.dtype | None = None
    if masters and config.torch_dtype != torch.float32:
        model.to(torch.float32)
        autocast = config.torch_dtype
    enable_autocast(model, autocast)
    return PolicyMemory(
        checkpointed_blocks=blocks,
        frozen_tensors=frozen,
        trainable_params=trainable_parameters(model),
        total_params=sum(p.numel() for p in model.parameters()),
        autocast=autocast,
    )
