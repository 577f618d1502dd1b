"""Tensor (de)serialisation helpers that send storage out of band under pickle protocol 5.

``torch.Tensor``'s own pickling copies the storage into the pickle stream, so a
``buffer_callback`` never sees it. These helpers turn a tensor into a small
``(buffer, dtype, shape, device)`` payload whose buffer is a ``pickle.PickleBuffer``
over the tensor's bytes (protocol >= 5: out of band, zero-copy on CPU) or plain
``bytes`` (older protocols). Rebuilt tensors view the received buffer without a copy
when they can; such tensors are read-only by contract (every segment of a
``PackedTensor`` is), so a non-writable buffer is not copied, except for tensors rebuilt
with ``writable=True`` (a ``TrainBatch``'s per-row tensors, small and editable in place).

Invariants: ``_rebuild_tensor(*_tensor_payload(t, p))`` equals ``t`` in dtype, shape,
values and device type for every protocol ``p``; bf16 and other dtypes numpy lacks
round-trip (the bytes travel as ``uint8``).
"""

from __future__ import annotations

import contextlib
import pickle
import warnings
from typing import Any, cast

import torch

TensorPayload = tuple[Any, str, tuple[int, ...], str]


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r} in a pickled tensor")
    return dtype


def _tensor_payload(t: torch.Tensor, protocol: int) -> TensorPayload:
    """``(buffer, dtype name, shape, device)`` for ``t``; the buffer goes out of band at protocol 5."""
    device = str(t.device)
    flat = t.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous().reshape(-1)
    array = flat.view(torch.uint8).numpy()
    buffer: Any = pickle.PickleBuffer(cast(Any, array)) if protocol >= 5 else array.tobytes()
    return buffer, str(t.dtype), tuple(t.shape), device


def _rebuild_tensor(
    buffer: Any, dtype_name: str, shape: tuple[int, ...], device: str, *, writable: bool = False
) -> torch.Tensor:
    """The tensor of a payload, viewing ``buffer`` without a copy.

    ``writable=True`` (per-row tensors a consumer may edit in place) copies out of a
    read-only buffer (Ray's object store, shared memory): writing through a view of it
    would corrupt memory the receiver does not own.
    """
    dtype = _dtype_from_name(dtype_name)
    numel = 1
    for d in shape:
        numel *= d
    if numel == 0:
        out = torch.empty(shape, dtype=dtype)
    else:
        with warnings.catch_warnings():
            # Received buffers may be read-only; segments are read-only by contract, so no copy.
            warnings.filterwarnings("ignore", message=".*not writable.*")
            warnings.filterwarnings("ignore", message=".*non-writable.*")
            raw = torch.frombuffer(buffer, dtype=torch.uint8)
        out = raw.view(dtype).reshape(shape)
    if device != "cpu":
        # A receiver without that device keeps the data on CPU rather than failing to load.
        with contextlib.suppress(RuntimeError, AssertionError):
            out = out.to(device)
    if writable and numel and out.device.type == "cpu" and memoryview(buffer).readonly:
        out = out.clone()  # still a view of the read-only buffer (a device move would have copied)
    return out
