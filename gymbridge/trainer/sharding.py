"""FSDP2 sharding of a policy: :func:`shard_model` and what each rank then holds (:func:`resident_bytes`).

:func:`shard_model` applies ``torch.distributed.fsdp.fully_shard`` to every submodule whose class the
model names in a ``_no_split_modules`` (its decoder layers, vision blocks, audio encoder layers: the
union over the model's pretrained submodules), to every pretrained submodule (the encoders, the base
model) and to the input embeddings and output head (one unit when tied), innermost first, then to
the root, so each unit's parameters are gathered only around its own forward and backward, whichever
of them the trainer calls directly (the base and the head apart, an encoder for deduplicated media).
The model code knows nothing of it. With ``mp_dtype`` the units compute in that dtype from fp32
master weights and reduce gradients in fp32 (``MixedPrecisionPolicy``); ``cpu_offload`` keeps the
shards, their gradients and the optimizer state on the CPU (``CPUOffloadPolicy``).

Invariants:

* gradients are **summed** over ranks (divide factor 1): every rank's loss already divides by the
  whole batch's normaliser, so the sum is the full batch's gradient;
* every rank must run the same FSDP units the same number of times per step (the collectives are
  inside forward and backward); :class:`~gymbridge.trainer.ray_dp.FSDPWorker` keeps its ranks in
  lockstep, this module does not.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["ResidentBytes", "claim_root", "no_split_classes", "resident_bytes", "shard_model"]


def no_split_classes(model: Any) -> set[str]:
    """Class names the model's pretrained (sub)modules list in ``_no_split_modules`` (the FSDP units)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def shard_model(
    model: torch.nn.Module,
    *,
    mp_dtype: torch.dtype | None,
    cpu_offload: bool,
    reshard_after_forward: bool = True,
    mesh: Any | None = None,
) -> torch.nn.Module:
    """``fully_shard`` every ``_no_split_modules`` block of ``model`` (innermost first), then the root.

    ``mp_dtype``: the compute dtype (parameters stay as they are, gradients reduce in fp32); ``None``:
    compute in the parameters' dtype. ``mesh``: a 1-D device mesh (default: the whole default group).
    Works on a meta-device model (materialise it after, with ``to_empty``). Returns ``model``, whose
    parameters are now ``DTensor`` shards.
    """
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    units = no_split_classes(model)
    mp = (
        MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32)
        if mp_dtype is not None
        else MixedPrecisionPolicy()
    )
    # pinned host memory needs an accelerator to pin for
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    kwargs: dict[str, Any] = {"mp_policy": mp, "offload_policy": offload}
    if mesh is not None:
        kwargs["mesh"] = mesh
    head = _embedding(model, "get_output_embeddings")
    embed = _embedding(model, "get_input_embeddings")
    tied = False
    if head is not None and embed is not None and head.weight is embed.weight:
        tied = True  # one weight, one unit: gathered whichever of the two is called
        fully_shard([embed, head], reshard_after_forward=reshard_after_forward, **kwargs)
    loose = set() if tied else {id(m) for m in (head, embed) if m is not None}
    # the trainer calls some submodules directly (the base without the head, the head, an encoder,
    # the input embeddings): each is a unit of its own, so its own forward gathers what it uses
    chosen = [
        m
        for m in model.modules()
        if m is not model
        # the class or a base (a block swapped for its checkpointed subclass keeps its base's name)
        and (
            any(c.__name__ in units for c in type(m).__mro__)
            or hasattr(m, "_no_split_modules")
            or id(m) in loose
        )
    ]
    # post-order: a block nested in another (an encoder's layers in the encoder) is sharded first
    for module in reversed(chosen):
        fully_shard(module, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):  # a sum over ranks: each rank divides by the whole batch already
            module.set_gradient_divide_factor(1.0)
            # a plain SUM (gloo has no PREMUL_SUM, and a factor of 1 needs no division)
            module.set_force_sum_reduction_for_comms(True)
    logger.debug("sharded %s: %d unit(s) below the root", type(model).__name__, len(chosen) + int(tied))
    return model


def _embedding(model: torch.nn.Module, getter: str) -> torch.nn.Module | None:
    get = getattr(model, getter, None)
    module = get() if get is not None else None
    return module if isinstance(module, torch.nn.Module) and hasattr(module, "weight") else None


def claim_root(model: torch.nn.Module) -> None:
    """Make ``model`` the FSDP root now (after it is materialised), not whichever unit runs first.

    FSDP2 takes as root the first sharded module whose forward runs; the trainer may call an inner
    unit first (an encoder for deduplicated media, the base without the head), which would make
    the root's later forward fail. No public API does this in torch 2.13; the private call is the
    one FSDP2 itself makes on the root's first forward.
    """
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        raise TypeError(f"claim_root: {type(model).__name__} is not sharded (shard_model first)")
    model._get_fsdp_state()._lazy_init()


@dataclass(frozen=True)
class ResidentBytes:
    """What one rank holds of the training state, bytes of its local tensors."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer}


def _local_nbytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return int(local.numel() * local.element_size())


def resident_bytes(model: torch.nn.Module, optimizer: Any | None = None) -> ResidentBytes:
    """Bytes this rank holds: parameters (local shards), gradients, optimizer state tensors."""
    params = sum(_local_nbytes(p) for p in model.parameters())
    grads = sum(_local_nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    opt = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            opt += sum(_local_nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return ResidentBytes(params, grads, opt)
