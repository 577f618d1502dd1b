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

Publication (:func:`pack_shards`, :class:`GatheredBucket`): FSDP2 shards every parameter on dim 0
with ``torch.chunk`` semantics (``ceil(rows / world)`` rows per rank, the last ranks short or empty).
Each rank copies its local rows of a bucket's parameters into one flat buffer with a fixed slot per
parameter (padded to the full chunk), so one ``gather`` to rank 0 moves a whole bucket; rank 0 holds
the ranks' buffers, never a second copy of the full tensors, and the receiver copies each rank's
rows straight into its own parameter.

Invariants:

* gradients are **summed** over ranks (divide factor 1): every rank's loss already divides by the
  whole batch's normaliser, so the sum is the full batch's gradient;
* frozen parameters (frozen encoders, a LoRA policy's base weights) share their units with trainable
  ones (a LoRA layer's adapters): FSDP2 gathers them for the forward and reduce-scatters only the
  gradients that exist, so a rank holds gradients and AdamW state for its shards of the trainable
  parameters alone;
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

__all__ = [
    "GatheredBucket",
    "ResidentBytes",
    "ShardSlot",
    "claim_root",
    "no_split_classes",
    "pack_shards",
    "resident_bytes",
    "shard_model",
]


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


@dataclass(frozen=True)
class ShardSlot:
    """Where one dim-0 sharded parameter lies in every rank's flat buffer (:func:`pack_shards`).

    ``offset``: its first element in each rank's buffer; ``chunk_rows``: rows per rank
    (``ceil(shape[0] / world)``, the slot holds ``chunk_rows * row_numel`` elements).
    """

    name: str
    shape: tuple[int, ...]
    offset: int
    chunk_rows: int

    @property
    def row_numel(self) -> int:
        n = 1
        for d in self.shape[1:]:
            n *= d
        return n

    @property
    def slot_numel(self) -> int:
        return self.chunk_rows * self.row_numel

    def rank_rows(self, rank: int) -> int:
        """Rows rank ``rank`` holds (``torch.chunk``: full chunks, then one short one, then none)."""
        return max(0, min(self.chunk_rows, self.shape[0] - rank * self.chunk_rows))


def _dim0_sharded(p: torch.Tensor, world_size: int) -> bool:
    """Whether ``p`` is a DTensor sharded on dim 0 over a 1-D mesh of ``world_size`` ranks."""
    from torch.distributed.tensor import DTensor, Shard

    return (
        isinstance(p, DTensor)
        and p.device_mesh.ndim == 1
        and p.device_mesh.size() == world_size
        and tuple(p.placements) == (Shard(0),)
        and p.dim() > 0
    )


def pack_shards(
    params: dict[str, torch.Tensor],
    names: list[str],
    dtype: torch.dtype,
    world_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, tuple[ShardSlot, ...], list[str]]:
    """This rank's local rows of ``names`` in one flat ``[sum of slots]`` buffer of ``dtype`` on ``device``.

    Returns ``(buffer, slots, others)``: ``others`` are the names that are not dim-0 sharded
    DTensors (gather them whole). Every rank computes the same slots from the global shapes; the
    padding past a rank's rows is zeros.
    """
    from torch.distributed.tensor import DTensor

    slots: list[ShardSlot] = []
    others: list[str] = []
    offset = 0
    for name in names:
        p = params[name]
        if not _dim0_sharded(p, world_size):
            others.append(name)
            continue
        chunk = -(-int(p.shape[0]) // world_size)
        slot = ShardSlot(name, tuple(int(d) for d in p.shape), offset, chunk)
        slots.append(slot)
        offset += slot.slot_numel
    flat = torch.zeros(offset, dtype=dtype, device=device)
    with torch.no_grad():
        for slot in slots:
            p = params[slot.name]
            assert isinstance(p, DTensor)
            local = p.to_local()
            n = local.numel()
            if n > slot.slot_numel:
                raise RuntimeError(
                    f"{slot.name}: local shard {tuple(local.shape)} exceeds its {slot.chunk_rows}-row slot"
                )
            flat[slot.offset : slot.offset + n].view(local.shape).copy_(local)
    return flat, tuple(slots), others


@dataclass(frozen=True)
class GatheredBucket:
    """A bucket of full parameters as the ranks' flat shard buffers (rank order) and their slots.

    The buffers are ``uint8`` numpy arrays (so Ray moves them out of band, without a copy), viewed
    as ``dtype``; ``whole``: parameters gathered as full tensors (not dim-0 sharded).
    """

    dtype: str
    slots: tuple[ShardSlot, ...]
    buffers: tuple[Any, ...]
    whole: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(int(b.nbytes) for b in self.buffers) + sum(
            int(t.numel() * t.element_size()) for t in self.whole.values()
        )

    def _flats(self) -> list[torch.Tensor]:
        import warnings

        dtype = getattr(torch, self.dtype)
        out = []
        for b in self.buffers:
            with warnings.catch_warnings():  # Ray's buffers are read-only; they are only read here
                warnings.filterwarnings("ignore", message=".*not writable.*")
                out.append(torch.from_numpy(b).view(dtype))
        return out

    def copy_into(self, params: dict[str, torch.Tensor]) -> None:
        """Copy every parameter of the bucket into ``params`` (full tensors of the same shapes)."""
        flats = self._flats()
        with torch.no_grad():
            for slot in self.slots:
                dest = params[slot.name].view(-1)
                row = slot.row_numel
                for rank, flat in enumerate(flats):
                    n = slot.rank_rows(rank) * row
                    if n:
                        start = rank * slot.chunk_rows * row
                        dest[start : start + n].copy_(flat[slot.offset : slot.offset + n])
            for name, value in self.whole.items():
                params[name].copy_(value)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The bucket's parameters as new full tensors (tests and benchmarks)."""
        out = {s.name: torch.empty(s.shape, dtype=getattr(torch, self.dtype)) for s in self.slots}
        out.update({n: torch.empty_like(t) for n, t in self.whole.items()})
        self.copy_into(out)
        return out
