"""``PackedTensor``: ragged rows of shared tensor segments in one CSR representation.

A GRPO group repeats one prompt G times; its media must exist once. A
``PackedTensor`` holds:

* ``segments``: the unique physical tensors (one per processed media item);
* ``provenance``: one opaque id (a ``str``) per segment, the **only** evidence
  for merging two segments (never tensor identity or values);
* ``offsets`` (int64 ``[R+1]``) and ``refs`` (int64 ``[N]``): logical row ``r`` is
  the ordered list of segments ``refs[offsets[r]:offsets[r+1]]``.

Invariants (checked by the constructor):

* ``offsets[0] == 0``, ``offsets`` never decreases, ``offsets[-1] == len(refs)``;
  every ref is in ``[0, num_segments)``; empty rows are legal;
* provenance ids are unique within one ``PackedTensor`` (so after ``cat``,
  ``select``, ``shard`` every provenance appears once);
* every segment has the same dtype and number of dimensions, and
  ``0 <= pack_dim < ndim`` once there is a segment (a negative ``pack_dim`` counts from
  the end, as in torch, and is stored normalised; an empty one keeps it as given until
  ``cat`` meets a segment); ``offsets``/``refs`` always live on the CPU (they are
  index metadata; segments may live on any device);
* **shared segments are read-only by contract**: no operation here writes into a
  segment, and callers must not either (one segment backs many rows; an in-place
  edit would silently change all of them). Operations return new objects.

Value-preserving operations (``select``, ``repeat_interleave``, ``cat``, ``shard``,
``compact``, ``to(device)``, pickling) keep provenance; value-changing ones mint
new ids: ``to(dtype)`` derives ``sha256(old id, "cast", dtype)`` for the floating
segments it casts (deterministic, so two shards cast independently still merge),
``from_rows(..., dedup=False)`` / ``unshared()`` give fresh random ids.

All index arithmetic is done on int64 tensors (``cumsum``, ``repeat_interleave``,
``unique``); Python loops run over segments only, never over rows.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Iterator, Sequence
from typing import Any, SupportsIndex

import numpy as np
import torch

from gymbridge.tensors._serial import TensorPayload, _rebuild_tensor, _tensor_payload

logger = logging.getLogger(__name__)

__all__ = ["IndexLike", "PackedTensor", "derive_provenance", "new_provenance"]

IndexLike = SupportsIndex | slice | Sequence[int] | torch.Tensor
"""What ``select`` / ``__getitem__`` accept: an int, a slice, a list of ints, or an int64/bool tensor."""


def new_provenance() -> str:
    """A fresh random provenance id (for segments with no content key)."""
    return uuid.uuid4().hex


def derive_provenance(*parts: str) -> str:
    """A deterministic provenance id from its parts (content key, processor spec, output key, dtype, ...)."""
    h = hashlib.sha256()
    for part in parts:
        encoded = part.encode()
        h.update(len(encoded).to_bytes(8, "little"))  # length-framed: ("ab","c") != ("a","bc")
        h.update(encoded)
    return h.hexdigest()[:32]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _as_index(index: IndexLike, length: int) -> torch.Tensor:
    """Normalise ``index`` to an in-range int64 CPU tensor of row positions ``[K]``.

    Accepts an int, a slice, a list/tuple/numpy array of ints or bools, or an integer/bool
    tensor; a bool sequence is a mask over all rows.
    """
    if isinstance(index, slice):
        picked = range(*index.indices(length))  # any step, negative ones included, like a list
        if not picked:
            return torch.zeros(0, dtype=torch.int64)
        return torch.arange(picked.start, picked.stop, picked.step, dtype=torch.int64)
    if isinstance(index, torch.Tensor):
        idx = index.detach().to("cpu")
    else:
        arr = np.asarray(index)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iub":
            raise IndexError(f"row indices must be integers or booleans, got {arr.dtype}")
        idx = torch.from_numpy(arr.astype(np.bool_ if arr.dtype.kind == "b" else np.int64))
    if idx.dtype == torch.bool:
        if idx.shape != (length,):
            raise IndexError(f"boolean mask of shape {tuple(idx.shape)} for {length} rows")
        return torch.nonzero(idx, as_tuple=False).reshape(-1)
    if idx.is_floating_point() or idx.is_complex():
        raise IndexError(f"row indices must be integers, got {idx.dtype}")
    idx = idx.to(torch.int64).reshape(-1)
    if idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < -length or hi >= length:
            raise IndexError(f"row index out of range for {length} rows (got {lo if lo < -length else hi})")
        idx = torch.where(idx < 0, idx + length, idx)
    return idx


def _repeat_index(repeats: int | torch.Tensor, length: int) -> torch.Tensor:
    """Row positions ``[sum(repeats)]`` repeating each of ``length`` rows ``repeats`` times.

    ``repeats`` is an int or an integer tensor with one count per row (or a single count);
    negative or mis-sized counts raise ``ValueError``.
    """
    rows = torch.arange(length, dtype=torch.int64)
    if not isinstance(repeats, torch.Tensor):
        count = int(repeats)
        if count < 0:
            raise ValueError(f"repeats must be >= 0, got {count}")
        return torch.repeat_interleave(rows, count)
    if repeats.is_floating_point() or repeats.is_complex():
        raise ValueError(f"repeats must be integers, got {repeats.dtype}")
    reps = repeats.detach().to("cpu", torch.int64).reshape(-1)
    if reps.numel() == 1:
        reps = reps.expand(length)
    if reps.numel() != length:
        raise ValueError(f"repeats has {reps.numel()} counts for {length} rows")
    if length and int(reps.min()) < 0:
        raise ValueError(f"repeats must be >= 0, got {int(reps.min())}")
    return torch.repeat_interleave(rows, reps, output_size=int(reps.sum()))


def _gather(
    offsets: torch.Tensor, refs: torch.Tensor, idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR row gather: the ``(offsets, refs)`` of rows ``idx`` in that order (vectorised)."""
    counts = (offsets[1:] - offsets[:-1])[idx]
    new_offsets = torch.zeros(idx.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts, dim=0, out=new_offsets[1:])
    total = int(new_offsets[-1])
    shift = offsets[:-1][idx] - new_offsets[:-1]
    positions = torch.repeat_interleave(shift, counts, output_size=total) + torch.arange(
        total, dtype=torch.int64
    )
    return new_offsets, refs[positions]


def _normalise_dim(dim: int, ndim: int) -> int:
    """``dim`` in ``[0, ndim)``; a negative one counts from the end (torch's rule)."""
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"pack_dim {dim} out of range for {ndim}-dim segments (expected {-ndim}..{ndim - 1})"
        )
    return dim + ndim if dim < 0 else dim


class PackedTensor:
    """Ragged rows of shared tensor segments (CSR). See the module docstring for the invariants.

    Build with :meth:`from_rows`; every transform returns a new object and never
    writes into a segment.
    """

    __slots__ = ("_offsets", "_pack_dim", "_provenance", "_refs", "_segments")

    def __init__(
        self,
        segments: Sequence[torch.Tensor],
        provenance: Sequence[str],
        offsets: torch.Tensor,
        refs: torch.Tensor,
        pack_dim: int = 0,
    ) -> None:
        self._segments: tuple[torch.Tensor, ...] = tuple(segments)
        self._provenance: tuple[str, ...] = tuple(provenance)
        self._offsets = offsets.to(device="cpu", dtype=torch.int64).reshape(-1)
        self._refs = refs.to(device="cpu", dtype=torch.int64).reshape(-1)
        self._pack_dim = int(pack_dim)
        self._check()

    def _check(self) -> None:
        segs, offsets, refs = self._segments, self._offsets, self._refs
        if len(self._provenance) != len(segs):
            raise ValueError(f"{len(segs)} segments but {len(self._provenance)} provenance ids")
        if len(set(self._provenance)) != len(self._provenance):
            raise ValueError("provenance ids must be unique within a PackedTensor")
        if offsets.numel() == 0 or int(offsets[0]) != 0:
            raise ValueError("offsets must start at 0")
        if offsets.numel() > 1 and bool((offsets[1:] < offsets[:-1]).any()):
            raise ValueError("offsets must never decrease")
        if int(offsets[-1]) != refs.numel():
            raise ValueError(f"offsets end at {int(offsets[-1])} but there are {refs.numel()} refs")
        if refs.numel() and (int(refs.min()) < 0 or int(refs.max()) >= len(segs)):
            raise ValueError(f"refs out of range for {len(segs)} segments")
        if segs:
            self._pack_dim = _normalise_dim(self._pack_dim, segs[0].dim())
            dtype, ndim = segs[0].dtype, segs[0].dim()
            for i, s in enumerate(segs):
                if s.dtype != dtype or s.dim() != ndim:
                    raise ValueError(
                        f"segment {i} is {s.dtype} with {s.dim()} dims; segment 0 is {dtype} with {ndim} dims"
                    )

    # ------------------------------------------------------------------ build
    @classmethod
    def from_rows(
        cls,
        rows: Sequence[Sequence[torch.Tensor]],
        provenance: Sequence[Sequence[str | None]] | None = None,
        pack_dim: int = 0,
        *,
        dedup: bool = True,
    ) -> PackedTensor:
        """Build from a list of rows, each an ordered list of tensors.

        With ``dedup=True`` a segment is stored once per provenance id; where
        ``provenance`` is ``None`` (or an entry is ``None``) the tensor object's
        identity stands in for it and a random id is minted, so the same tensor
        object in several rows is stored once. Two references with one provenance
        must have the same shape and dtype (``ValueError`` otherwise).
        ``dedup=False`` stores one copy per reference with fresh ids (the A/B baseline).
        """
        if provenance is not None and len(provenance) != len(rows):
            raise ValueError(f"provenance has {len(provenance)} rows, values have {len(rows)}")
        segments: list[torch.Tensor] = []
        provs: list[str] = []
        by_key: dict[object, int] = {}
        refs: list[int] = []
        lengths: list[int] = []
        for r, row in enumerate(rows):
            row_prov = provenance[r] if provenance is not None else None
            if row_prov is not None and len(row_prov) != len(row):
                raise ValueError(f"row {r}: {len(row)} tensors but {len(row_prov)} provenance ids")
            lengths.append(len(row))
            for j, t in enumerate(row):
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"row {r} item {j} is {type(t).__name__}, not a torch.Tensor")
                pid = row_prov[j] if row_prov is not None else None
                if not dedup:
                    refs.append(len(segments))
                    segments.append(t.detach().clone())
                    provs.append(new_provenance())
                    continue
                key: object = pid if pid is not None else ("object", id(t))
                found = by_key.get(key)
                if found is None:
                    found = len(segments)
                    by_key[key] = found
                    segments.append(t.detach() if t.requires_grad else t)
                    provs.append(pid if pid is not None else new_provenance())
                elif pid is not None:
                    _check_same_value_shape(segments[found], t, pid)
                refs.append(found)
        offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
        torch.cumsum(torch.tensor(lengths, dtype=torch.int64), dim=0, out=offsets[1:])
        return cls(segments, provs, offsets, torch.tensor(refs, dtype=torch.int64), pack_dim)

    @classmethod
    def empty(cls, num_rows: int = 0, pack_dim: int = 0) -> PackedTensor:
        """``num_rows`` empty rows and no segments."""
        return cls(
            (), (), torch.zeros(num_rows + 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), pack_dim
        )

    # ------------------------------------------------------------------ read
    @property
    def segments(self) -> tuple[torch.Tensor, ...]:
        """The unique physical tensors; read-only by contract."""
        return self._segments

    @property
    def provenance(self) -> tuple[str, ...]:
        return self._provenance

    @property
    def offsets(self) -> torch.Tensor:
        """int64 ``[R+1]`` (CPU); do not modify."""
        return self._offsets

    @property
    def refs(self) -> torch.Tensor:
        """int64 ``[N]`` (CPU); do not modify."""
        return self._refs

    @property
    def pack_dim(self) -> int:
        return self._pack_dim

    @property
    def dtype(self) -> torch.dtype | None:
        return self._segments[0].dtype if self._segments else None

    @property
    def device(self) -> torch.device | None:
        return self._segments[0].device if self._segments else None

    def __len__(self) -> int:
        return self._offsets.numel() - 1

    @property
    def num_segments(self) -> int:
        return len(self._segments)

    @property
    def num_refs(self) -> int:
        return self._refs.numel()

    def segment_counts(self) -> torch.Tensor:
        """Segments per row, int64 ``[R]``."""
        return self._offsets[1:] - self._offsets[:-1]

    def row(self, i: SupportsIndex) -> list[torch.Tensor]:
        """Row ``i``'s segments, in order (the shared tensors themselves: do not modify)."""
        n = len(self)
        k = i.__index__()
        if not -n <= k < n:
            raise IndexError(f"row {k} out of range for {n} rows")
        k %= n
        lo, hi = int(self._offsets[k]), int(self._offsets[k + 1])
        return [self._segments[j] for j in self._refs[lo:hi].tolist()]

    def rows(self) -> Iterator[list[torch.Tensor]]:
        for i in range(len(self)):
            yield self.row(i)

    def segment_nbytes(self) -> torch.Tensor:
        """Bytes per segment, int64 ``[S]``."""
        return torch.tensor([_nbytes(s) for s in self._segments], dtype=torch.int64)

    @property
    def physical_nbytes(self) -> int:
        """Bytes of the unique segments (what is stored / sent)."""
        return sum(_nbytes(s) for s in self._segments)

    @property
    def logical_nbytes(self) -> int:
        """Bytes of every reference (what a dense copy would take)."""
        if not self._refs.numel():
            return 0
        return int(self.segment_nbytes()[self._refs].sum())

    def materialize(self, *, pad: bool = False, pad_value: float = 0.0) -> torch.Tensor | None:
        """All rows' segments concatenated along ``pack_dim`` in logical order; ``None`` when empty.

        Segments whose other dims differ raise ``ValueError`` unless ``pad=True``, which
        pads every segment's other dims (at the end) to the maximum with ``pad_value``.
        The result is a new tensor; no segment is written.
        """
        if not self._refs.numel():
            return None
        parts = [self._segments[j] for j in self._refs.tolist()]
        d = self._pack_dim
        other = {tuple(s.shape[:d]) + tuple(s.shape[d + 1 :]) for s in self._segments}
        if len(other) > 1:
            if not pad:
                raise ValueError(
                    f"ragged segments (shapes differ outside pack_dim={d}); pass pad=True to pad them"
                )
            ndim = self._segments[0].dim()
            target = [max(s.shape[k] for s in self._segments) for k in range(ndim)]
            padded: dict[int, torch.Tensor] = {}
            for j in set(self._refs.tolist()):
                s = self._segments[j]
                spec: list[int] = []
                for k in reversed(range(ndim)):
                    spec.extend([0, 0 if k == d else target[k] - s.shape[k]])
                padded[j] = torch.nn.functional.pad(s, spec, value=pad_value) if any(spec) else s
            parts = [padded[j] for j in self._refs.tolist()]
        return torch.cat(parts, dim=d)

    # ------------------------------------------------------------------ transform
    def _with_index(self, offsets: torch.Tensor, refs: torch.Tensor) -> PackedTensor:
        """A new PackedTensor over these rows, keeping only the segments they reference."""
        if refs.numel() == 0:
            return PackedTensor((), (), offsets, refs, self._pack_dim)
        used, inverse = torch.unique(refs, sorted=True, return_inverse=True)
        keep = used.tolist()
        return PackedTensor(
            [self._segments[j] for j in keep],
            [self._provenance[j] for j in keep],
            offsets,
            inverse.to(torch.int64),
            self._pack_dim,
        )

    def select(self, indices: IndexLike) -> PackedTensor:
        """Rows ``indices`` in that order (repeats allowed); unreferenced segments are dropped."""
        idx = _as_index(indices, len(self))
        offsets, refs = _gather(self._offsets, self._refs, idx)
        return self._with_index(offsets, refs)

    def __getitem__(self, index: IndexLike) -> PackedTensor:
        """Like :meth:`select`; an int gives a one-row ``PackedTensor`` (use :meth:`row` for its segments)."""
        return self.select(index)

    def repeat_interleave(self, repeats: int | torch.Tensor) -> PackedTensor:
        """Repeat each row ``repeats`` times (int or int64 ``[R]``), like ``torch.repeat_interleave``."""
        return self.select(_repeat_index(repeats, len(self)))

    def compact(self) -> PackedTensor:
        """The same rows without segments no row references."""
        return self._with_index(self._offsets, self._refs)

    def split(self, sizes: Sequence[int]) -> list[PackedTensor]:
        """Consecutive pieces of ``sizes`` rows each (must sum to ``len(self)``), each compacted."""
        if sum(sizes) != len(self) or any(s < 0 for s in sizes):
            raise ValueError(f"split sizes {list(sizes)} do not partition {len(self)} rows")
        bounds = torch.cumsum(torch.tensor([0, *sizes], dtype=torch.int64), dim=0).tolist()
        return [self.select(slice(bounds[k], bounds[k + 1])) for k in range(len(sizes))]

    def shard(self, num_shards: int) -> list[PackedTensor]:
        """``num_shards`` consecutive pieces whose sizes differ by at most one; each re-interned."""
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        pieces = torch.tensor_split(torch.arange(len(self), dtype=torch.int64), num_shards)
        return [self.select(p) for p in pieces]

    @staticmethod
    def cat(values: Sequence[PackedTensor]) -> PackedTensor:
        """Rows of ``values`` one after another; segments re-interned by provenance (equal ids merge)."""
        if not values:
            raise ValueError("PackedTensor.cat needs at least one value")
        ndim = next((v.segments[0].dim() for v in values if v.segments), None)
        pack_dim = values[0].pack_dim if ndim is None else _normalise_dim(values[0].pack_dim, ndim)
        segments: list[torch.Tensor] = []
        provs: list[str] = []
        by_prov: dict[str, int] = {}
        refs_parts: list[torch.Tensor] = []
        offsets_parts: list[torch.Tensor] = [torch.zeros(1, dtype=torch.int64)]
        base = 0
        for v in values:
            if (v.pack_dim if ndim is None else _normalise_dim(v.pack_dim, ndim)) != pack_dim:
                raise ValueError(f"cannot cat pack_dim {v.pack_dim} with pack_dim {pack_dim}")
            mapping: list[int] = []
            for seg, pid in zip(v.segments, v.provenance, strict=True):
                k = by_prov.get(pid)
                if k is None:
                    k = len(segments)
                    by_prov[pid] = k
                    segments.append(seg)
                    provs.append(pid)
                else:
                    _check_same_value_shape(segments[k], seg, pid)
                mapping.append(k)
            refs_parts.append(torch.tensor(mapping, dtype=torch.int64)[v.refs] if mapping else v.refs)
            offsets_parts.append(v.offsets[1:] + base)
            base += v.num_refs
        return PackedTensor(segments, provs, torch.cat(offsets_parts), torch.cat(refs_parts), pack_dim)

    def to(
        self,
        target: torch.device | str | torch.dtype | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        non_blocking: bool = False,
    ) -> PackedTensor:
        """Move segments to ``device`` (provenance kept) and/or cast **floating** segments to ``dtype``.

        A cast that changes a segment's dtype derives a new provenance id from the old
        one and the dtype; integer/bool segments (e.g. grid sizes) are never cast.
        """
        if isinstance(target, torch.dtype):
            dtype = target
        elif target is not None:
            device = target
        if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
            raise ValueError(f"to(dtype) casts floating segments only; {dtype} is not a floating dtype")
        segments: list[torch.Tensor] = []
        provs: list[str] = []
        for seg, pid in zip(self._segments, self._provenance, strict=True):
            new = seg
            if device is not None:
                new = new.to(device=device, non_blocking=non_blocking)
            if dtype is not None and seg.is_floating_point() and seg.dtype != dtype:
                new = new.to(dtype=dtype)
                pid = derive_provenance(pid, "cast", str(dtype))
            segments.append(new)
            provs.append(pid)
        return PackedTensor(segments, provs, self._offsets, self._refs, self._pack_dim)

    def unshared(self) -> PackedTensor:
        """The dedup-off twin: one copied segment per reference, fresh ids, same rows and values."""
        segs = [self._segments[j].clone() for j in self._refs.tolist()]
        return PackedTensor(
            segs,
            [new_provenance() for _ in segs],
            self._offsets,
            torch.arange(len(segs), dtype=torch.int64),
            self._pack_dim,
        )

    # ------------------------------------------------------------------ pickling
    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        p = protocol.__index__()
        return (
            _rebuild_packed,
            (
                tuple(_tensor_payload(s, p) for s in self._segments),
                self._provenance,
                _tensor_payload(self._offsets, p),
                _tensor_payload(self._refs, p),
                self._pack_dim,
            ),
        )

    def __repr__(self) -> str:
        return (
            f"PackedTensor(rows={len(self)}, segments={self.num_segments}, refs={self.num_refs}, "
            f"dtype={self.dtype}, pack_dim={self._pack_dim}, physical_nbytes={self.physical_nbytes}, "
            f"logical_nbytes={self.logical_nbytes})"
        )


def _check_same_value_shape(kept: torch.Tensor, other: torch.Tensor, pid: str) -> None:
    if kept.shape != other.shape or kept.dtype != other.dtype:
        raise ValueError(
            f"provenance {pid!r} names tensors of different shape/dtype: "
            f"{tuple(kept.shape)} {kept.dtype} vs {tuple(other.shape)} {other.dtype}"
        )


def _rebuild_packed(
    segments: tuple[TensorPayload, ...],
    provenance: tuple[str, ...],
    offsets: TensorPayload,
    refs: TensorPayload,
    pack_dim: int,
) -> PackedTensor:
    return PackedTensor(
        [_rebuild_tensor(*s) for s in segments],
        provenance,
        _rebuild_tensor(*offsets),
        _rebuild_tensor(*refs),
        pack_dim,
    )
