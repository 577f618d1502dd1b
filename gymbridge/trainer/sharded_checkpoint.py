"""Sharded checkpoints of FSDP2 models: every rank writes its own slices, any world size reads them.

A checkpoint is one directory (shared by all ranks) holding, for a save on ``n`` ranks::

    rank-<r>-of-<n>.safetensors   the slices rank r holds (a standard safetensors file)
    rank-<r>-of-<n>.json          its index: every tensor's dtype and global shape, the global
                                  offsets and shape of r's slice, the sha256 of the .safetensors
    index.json                    written last, by rank 0: format, world size, the caller's meta
                                  (a JSON string), the sha256 of every rank index, its own sha256

:func:`save_sharded` writes each rank's ``DTensor.to_local()`` slices (plain tensors whole, from
rank 0 only) and streams them: safetensors' writers take every tensor of a file at once, so the
file's header (8-byte length + JSON, as the safetensors format specifies) is built here from
shapes and dtypes and the bytes follow tensor by tensor in chunks of at most ``bucket_mb``,
hashed on the way, through :func:`gymbridge.safe_io.write_atomic`. Host memory beyond the shard
itself is one chunk. :func:`load_sharded` fills DTensor or plain targets in place, reading only
the slices each target needs (``safe_open(...).get_slice``), so ``n`` ranks' files load on any
number of ranks; :func:`iter_full_tensors` assembles whole tensors one at a time with no process
group. :func:`flatten_model_and_optimizer` / :func:`restore_model_and_optimizer` map a model and
its optimizer (``torch.distributed.checkpoint.state_dict``, FQN-keyed) to and from that format.
Of a LoRA model (:mod:`gymbridge.generation.lora`) only the published tensors (the adapters and any
fully trained encoder) and their optimizer state are saved, and the meta's ``"lora"`` holds the
adapter settings (:func:`sharded_checkpoint_lora`); the base weights are the base model's, never
saved: a load restores the adapters into a model that already holds the same base and adapters.

Invariants:

* nothing loaded can run code: safetensors and orjson only (no pickle, no ``torch.load``), JSON
  nesting bounded by :data:`gymbridge.safe_io.MAX_META_DEPTH`; collectives carry no objects.
* ``index.json`` exists only after every rank's files are complete: rank 0 removes it before
  anything is written and writes it after all ranks agree they succeeded, so a crash mid-save
  leaves a checkpoint that counts as absent (:func:`is_complete` is ``False``).
* every file's sha256 is checked before it is used (``index.json`` against itself, rank indexes
  against ``index.json``, data files against their rank index); a missing, truncated, edited or
  inconsistent file raises :class:`~gymbridge.errors.CheckpointError` naming it. The checksum
  detects accidents; safety against a hostile file comes from the format, as in ``safe_io``.
* the directory is shared by all ranks (every rank may read every rank's files), and all ranks
  pass the same tensor names, shapes and dtypes to a save.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import struct
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import orjson
import torch

from gymbridge.errors import CheckpointError
from gymbridge.limits import json_too_deep
from gymbridge.safe_io import MAX_META_DEPTH, write_atomic

logger = logging.getLogger(__name__)

__all__ = [
    "INDEX_NAME",
    "SHARDED_FORMAT",
    "flatten_model_and_optimizer",
    "full_optimizer_state",
    "is_complete",
    "iter_full_tensors",
    "load_sharded",
    "read_meta",
    "restore_model_and_optimizer",
    "save_sharded",
    "sharded_checkpoint_lora",
]

SHARDED_FORMAT = "gymbridge-sharded/1"
"""The ``format`` of ``index.json`` and of every rank index."""

INDEX_NAME = "index.json"
"""The top-level index; its presence is what makes a checkpoint directory complete."""

_OPTIM_FORMAT = "gymbridge-model-optimizer/1"
_DIGEST_KEY = "gymbridge.sha256"
_ZERO_DIGEST = "0" * 64
_DIGEST_FIELD = re.compile(rb'"gymbridge\.sha256":"([0-9a-f]{64})"')
_RANK_FILE = re.compile(r"^rank-(\d+)-of-(\d+)\.(safetensors|json)$")

# torch dtype -> safetensors header dtype (the safetensors format specification's names)
_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_DTYPES_BY_NAME: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in _ST_DTYPES}


def _stem(rank: int, world_size: int) -> str:
    return f"rank-{rank}-of-{world_size}"


def is_complete(directory: str | Path) -> bool:
    """Whether ``directory`` holds a finished sharded checkpoint (its ``index.json`` exists).

    Files are checked when loaded, not here."""
    return (Path(directory) / INDEX_NAME).is_file()


# ---------------------------------------------------------------------------- JSON with a digest
def _dumps_with_digest(body: dict[str, Any]) -> bytes:
    """``body`` as JSON with a ``gymbridge.sha256`` of the bytes (the digest field zeroed)."""
    data = bytearray(orjson.dumps({**body, _DIGEST_KEY: _ZERO_DIGEST}))
    fields = list(_DIGEST_FIELD.finditer(data))
    if len(fields) != 1:  # cannot happen: other strings are escaped, and no other key has that name
        raise RuntimeError("index JSON does not hold exactly one digest field")
    start = fields[0].start(1)
    data[start : start + 64] = hashlib.sha256(data).hexdigest().encode()
    return bytes(data)


def _loads_checked(path: Path, raw: bytes) -> dict[str, Any]:
    """Parse ``raw`` (JSON object, nesting at most ``MAX_META_DEPTH``) or raise naming ``path``."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise CheckpointError(path, f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise CheckpointError(path, f"holds a JSON {type(value).__name__}, not an object")
    if json_too_deep(value, MAX_META_DEPTH):
        raise CheckpointError(path, f"nests deeper than {MAX_META_DEPTH} levels")
    if value.get("format") != SHARDED_FORMAT:
        raise CheckpointError(path, f"format {value.get('format')!r}, expected {SHARDED_FORMAT!r}")
    return value


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError as exc:
        raise CheckpointError(path, f"missing ({what})") from exc
    except OSError as exc:
        raise CheckpointError(path, f"cannot read: {exc.strerror or exc}") from exc


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    try:
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except FileNotFoundError as exc:
        raise CheckpointError(path, "missing (a rank's data file)") from exc
    except OSError as exc:
        raise CheckpointError(path, f"cannot read: {exc.strerror or exc}") from exc
    return h.hexdigest()


# ---------------------------------------------------------------------------- save
@dataclass(frozen=True)
class _Slice:
    """What one rank holds of one tensor: ``local`` is ``[*shape]`` at ``offsets`` of ``global_shape``."""

    name: str
    dtype: torch.dtype
    local: torch.Tensor | None  # None: another rank writes this tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


def _local_slice(name: str, tensor: torch.Tensor, rank: int) -> _Slice:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(name, str):
        raise TypeError(f"tensor names must be str, got {type(name).__name__}")
    if name == "__metadata__":  # the safetensors header's reserved key
        raise ValueError("a tensor cannot be named '__metadata__'")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensors[{name!r}] is a {type(tensor).__name__}, not a torch.Tensor")
    if tensor.dtype not in _ST_DTYPES:
        raise TypeError(f"tensors[{name!r}] has dtype {tensor.dtype}, which the format cannot hold")
    global_shape = tuple(int(s) for s in tensor.shape)
    if not isinstance(tensor, DTensor):
        whole = tensor.detach() if rank == 0 else None
        return _Slice(name, tensor.dtype, whole, global_shape, (0,) * len(global_shape))
    mesh, placements = tensor.device_mesh, tuple(tensor.placements)
    for dim, placement in enumerate(placements):
        if not isinstance(placement, Shard | Replicate):
            raise ValueError(
                f"tensors[{name!r}] has placement {placement} on mesh dim {dim}; reduce it first"
            )
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the tensor's mesh
        return _Slice(name, tensor.dtype, None, global_shape, (0,) * len(global_shape))
    # a replica beyond the first of each replicated mesh dim holds what another rank writes
    replica = any(isinstance(p, Replicate) and coordinate[d] != 0 for d, p in enumerate(placements))
    local_shape, offsets = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
    local = tensor.to_local().detach()
    if tuple(local.shape) != tuple(local_shape):
        raise ValueError(
            f"tensors[{name!r}]: local shape {tuple(local.shape)}, its placements say {local_shape}"
        )
    keep = not replica and local.numel() > 0
    return _Slice(name, tensor.dtype, local if keep else None, global_shape, tuple(int(o) for o in offsets))


class _Stager:
    """Chunks of a tensor's little-endian bytes for a file writer, holding at most one chunk.

    A contiguous CPU tensor is read in place (no copy); anything else (another device, a
    non-contiguous view) is copied a chunk at a time into one reused host buffer, so a chunk
    is valid only until the next one is asked for: :func:`gymbridge.safe_io.write_atomic`
    writes each chunk before it asks for the next.
    """

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def _stage(self, part: torch.Tensor) -> torch.Tensor:
        nbytes = part.numel() * part.element_size()
        if self._buffer.numel() < nbytes:  # grows to the largest chunk: chunk_bytes, or one row
            self._buffer = torch.empty(0, dtype=torch.uint8)
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        host = self._buffer[:nbytes].view(part.dtype).view(part.shape)
        host.copy_(part)
        return host

    def chunks(self, tensor: torch.Tensor) -> Iterator[memoryview]:
        """``tensor``'s bytes in chunks of at most ``chunk_bytes`` (at least one row of a
        non-contiguous tensor)."""
        if tensor.numel() == 0:
            return
        if tensor.dim() == 0:
            tensor = tensor.reshape(1)
        if tensor.is_contiguous():
            flat = tensor.reshape(-1)
            step = max(1, self.chunk_bytes // tensor.element_size())
            for start in range(0, flat.numel(), step):
                part = flat[start : start + step]
                if part.device.type != "cpu":
                    part = self._stage(part)
                yield part.view(torch.uint8).numpy().data
            return
        row_bytes = tensor[0].numel() * tensor.element_size()
        rows = max(1, self.chunk_bytes // max(1, row_bytes))
        for start in range(0, tensor.shape[0], rows):
            host = self._stage(tensor[start : start + rows])
            yield host.reshape(-1).view(torch.uint8).numpy().data


def _safetensors_header(slices: list[_Slice]) -> bytes:
    """The safetensors header (u64 length + JSON padded with spaces to 8 bytes) for ``slices`` in order."""
    header: dict[str, Any] = {"__metadata__": {"format": SHARDED_FORMAT}}
    offset = 0
    for s in slices:
        assert s.local is not None
        size = s.local.numel() * s.local.element_size()
        header[s.name] = {
            "dtype": _ST_DTYPES[s.local.dtype],
            "shape": list(s.local.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = orjson.dumps(header)
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _agree(ok: bool, group: Any, collective: bool) -> bool:
    """Whether every rank of ``group`` says ``ok`` (an all-reduce of one integer; no objects)."""
    if not collective:
        return ok
    import torch.distributed as dist

    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def save_sharded(
    directory: str | Path,
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
    *,
    rank: int,
    world_size: int,
    group: Any = None,
    bucket_mb: float = 64.0,
) -> int:
    """Write this rank's part of a sharded checkpoint of ``tensors`` and ``meta`` to ``directory``.

    Collective: every rank of ``group`` (default: the world) calls it with the same names and
    ``meta`` (only rank 0's ``meta`` is written). DTensors contribute their local slice (one copy
    of replicated slices); plain tensors are written whole by rank 0. Host memory beyond the
    tensors themselves is one chunk of ``bucket_mb`` MiB (a whole row of a non-contiguous tensor
    if that is larger; nothing for contiguous CPU tensors, which are written in place). With
    ``world_size == 1`` no process group is needed. Returns the bytes this rank wrote.

    When any rank fails, every rank raises (the failing one its own error, the others
    :class:`CheckpointError`) and no ``index.json`` is written.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
    if sys.byteorder != "little":  # safetensors stores little-endian bytes
        raise RuntimeError("sharded checkpoints are written on little-endian hosts only")
    collective = world_size > 1
    if collective:
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size(group) != world_size:
            raise ValueError(f"world_size={world_size} needs an initialized process group of that size")
        if dist.get_rank(group) != rank:
            raise ValueError(f"rank={rank}, but this process is rank {dist.get_rank(group)} of the group")
    root = Path(directory)
    stem = _stem(rank, world_size)
    index_path = root / INDEX_NAME
    meta_json = ""
    error: BaseException | None = None
    try:  # every failure from here on is agreed on, so no rank waits for one that raised
        meta_json = orjson.dumps(dict(meta)).decode()  # TypeError for what JSON cannot hold
        if json_too_deep(orjson.loads(meta_json), MAX_META_DEPTH):
            raise ValueError(f"meta nests deeper than {MAX_META_DEPTH} levels")
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            index_path.unlink(missing_ok=True)  # from here on a crash leaves no index
    except BaseException as exc:
        error = exc
    if not _agree(error is None, group, collective):  # nobody writes before the old index is gone
        if error is not None:
            raise error
        raise CheckpointError(index_path, "another rank failed to start the save")

    written = 0
    try:
        root.mkdir(parents=True, exist_ok=True)
        slices = [_local_slice(name, t, rank) for name, t in tensors.items()]
        held = [s for s in slices if s.local is not None]
        chunk_bytes = max(1, int(bucket_mb * 1024 * 1024))
        digest = hashlib.sha256()
        size = 0

        def stream() -> Iterator[bytes | memoryview]:
            nonlocal size
            header = _safetensors_header(held)
            digest.update(header)
            size += len(header)
            yield header
            stager = _Stager(chunk_bytes)
            for s in held:
                assert s.local is not None
                for chunk in stager.chunks(s.local):
                    digest.update(chunk)
                    size += chunk.nbytes
                    yield chunk

        # write_atomic writes any buffer, one chunk at a time (its annotation says bytes);
        # memoryviews spare a copy of every chunk
        write_atomic(root / f"{stem}.safetensors", cast("Iterator[bytes]", stream()))
        entries: dict[str, Any] = {}
        for s in slices:
            piece = None
            if s.local is not None:
                piece = {"offsets": list(s.offsets), "shape": list(s.local.shape)}
            dtype = str(s.dtype).removeprefix("torch.")
            entries[s.name] = {"dtype": dtype, "shape": list(s.global_shape), "piece": piece}
        rank_index = {
            "format": SHARDED_FORMAT,
            "rank": rank,
            "world_size": world_size,
            "data_sha256": digest.hexdigest(),
            "data_bytes": size,
            "tensors": entries,
        }
        raw_index = orjson.dumps(rank_index)
        write_atomic(root / f"{stem}.json", [raw_index])
        written = size + len(raw_index)
    except BaseException as exc:
        error = exc
    if not _agree(error is None, group, collective):
        if error is not None:
            raise error
        raise CheckpointError(
            root / f"{stem}.json", "another rank failed to write its files; no index written"
        )

    if rank == 0:
        try:
            written += _write_index(root, world_size, meta_json)
        except BaseException as exc:
            error = exc
    if not _agree(error is None, group, collective):
        if error is not None:
            raise error
        raise CheckpointError(index_path, "rank 0 failed to write the index")
    logger.debug("rank %d wrote %d bytes of the sharded checkpoint %s", rank, written, root)
    return written


def _write_index(root: Path, world_size: int, meta_json: str) -> int:
    """Hash every rank index, write ``index.json`` and remove rank files of other world sizes."""
    ranks = []
    for r in range(world_size):
        path = root / f"{_stem(r, world_size)}.json"
        ranks.append(hashlib.sha256(_read(path, "a rank index")).hexdigest())
    body = {"format": SHARDED_FORMAT, "world_size": world_size, "meta": meta_json, "rank_sha256": ranks}
    raw = _dumps_with_digest(body)
    write_atomic(root / INDEX_NAME, [raw])
    for entry in root.iterdir():
        m = _RANK_FILE.match(entry.name)
        if m is not None and int(m[2]) != world_size:
            entry.unlink(missing_ok=True)
    return len(raw)


# ---------------------------------------------------------------------------- read
@dataclass(frozen=True)
class _Piece:
    """One rank's slice of one tensor: ``shape`` at ``offsets`` (in ``file`` under key ``name``)."""

    file: Path
    index: Path
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass
class _Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    index: Path
    pieces: list[_Piece] = field(default_factory=list)


def _int_list(value: Any, length: int | None = None) -> tuple[int, ...]:
    ok = isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)
    if not ok or (length is not None and len(value) != length):
        raise ValueError(f"not a list of {length or 'some'} non-negative integers: {value!r}")
    return tuple(value)


class _Checkpoint:
    """The verified indexes of one checkpoint directory; data files are verified on first use."""

    def __init__(self, directory: str | Path) -> None:
        self.root = Path(directory)
        index_path = self.root / INDEX_NAME
        raw = _read(index_path, "no finished checkpoint here: the save did not complete")
        fields = list(_DIGEST_FIELD.finditer(raw))
        if len(fields) != 1:
            raise CheckpointError(index_path, "no gymbridge sha256 (not a sharded index, or corrupt)")
        start = fields[0].start(1)
        zeroed = raw[:start] + _ZERO_DIGEST.encode() + raw[start + 64 :]
        if hashlib.sha256(zeroed).hexdigest() != fields[0][1].decode():
            raise CheckpointError(index_path, "sha256 mismatch: the file is corrupt or was edited")
        index = _loads_checked(index_path, raw)
        try:
            world_size = index["world_size"]
            digests = index["rank_sha256"]
            if type(world_size) is not int or world_size < 1:
                raise ValueError(f"world_size {world_size!r}")
            if not isinstance(digests, list) or len(digests) != world_size:
                raise ValueError(f"rank_sha256 is not a list of {world_size} digests")
            meta = orjson.loads(index["meta"])
            if not isinstance(meta, dict) or json_too_deep(meta, MAX_META_DEPTH):
                raise ValueError(f"meta is not an object nesting at most {MAX_META_DEPTH} levels")
        except (KeyError, TypeError, ValueError, orjson.JSONDecodeError) as exc:
            raise CheckpointError(index_path, f"malformed: {type(exc).__name__}: {exc}") from exc
        self.meta: dict[str, Any] = meta
        self.world_size: int = world_size
        self.entries: dict[str, _Entry] = {}
        self._data_sha256: dict[Path, str] = {}
        self._handles: dict[Path, Any] = {}
        for r, expected in enumerate(digests):
            self._add_rank(r, expected)
        for name, entry in self.entries.items():
            covered = sum(math.prod(p.shape) for p in entry.pieces)
            if covered != math.prod(entry.shape):
                raise CheckpointError(
                    entry.index,
                    f"the slices of {name!r} cover {covered} of {math.prod(entry.shape)} elements",
                )

    def _add_rank(self, rank: int, expected_sha256: Any) -> None:
        stem = _stem(rank, self.world_size)
        path = self.root / f"{stem}.json"
        raw = _read(path, f"the index of rank {rank}")
        if hashlib.sha256(raw).hexdigest() != expected_sha256:
            raise CheckpointError(path, f"sha256 mismatch against {INDEX_NAME}: corrupt or edited")
        index = _loads_checked(path, raw)
        data = self.root / f"{stem}.safetensors"
        try:
            if index["rank"] != rank or index["world_size"] != self.world_size:
                raise ValueError(f"says rank {index['rank']} of {index['world_size']}")
            sha = index["data_sha256"]
            if not isinstance(sha, str) or len(sha) != 64:
                raise ValueError(f"data_sha256 {sha!r}")
            self._data_sha256[data] = sha
            tensors = index["tensors"]
            if not isinstance(tensors, dict):
                raise TypeError("tensors is not an object")
            for name, spec in tensors.items():
                dtype = _DTYPES_BY_NAME[spec["dtype"]]
                shape = _int_list(spec["shape"])
                entry = self.entries.setdefault(name, _Entry(dtype, shape, path))
                if (entry.dtype, entry.shape) != (dtype, shape):
                    raise ValueError(
                        f"{name!r} is {dtype} {list(shape)} here, "
                        f"{entry.dtype} {list(entry.shape)} in {entry.index.name}"
                    )
                piece = spec["piece"]
                if piece is None:
                    continue
                offsets = _int_list(piece["offsets"], len(shape))
                local = _int_list(piece["shape"], len(shape))
                if any(o + n > g for o, n, g in zip(offsets, local, shape, strict=True)):
                    raise ValueError(
                        f"slice of {name!r} at {list(offsets)} {list(local)} exceeds {list(shape)}"
                    )
                entry.pieces.append(_Piece(data, path, offsets, local))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(path, f"malformed: {type(exc).__name__}: {exc}") from exc

    def _open(self, path: Path) -> Any:
        from safetensors import safe_open

        handle = self._handles.get(path)
        if handle is not None:
            return handle
        if _file_sha256(path) != self._data_sha256[path]:
            raise CheckpointError(
                path, "sha256 mismatch: the file is corrupt (flipped bits, truncated or edited)"
            )
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as exc:  # a checksummed-but-crafted file: parsing may raise anything
            raise CheckpointError(path, f"malformed safetensors: {type(exc).__name__}: {exc}") from exc
        self._handles[path] = handle
        return handle

    def fill(self, name: str, dest: torch.Tensor, offsets: tuple[int, ...]) -> None:
        """Copy the region ``[offsets, offsets + dest.shape)`` of tensor ``name`` into ``dest``."""
        entry = self.entries[name]
        if dest.numel() == 0:
            return
        copied = 0
        for piece in entry.pieces:
            lo = [max(a, o) for a, o in zip(offsets, piece.offsets, strict=True)]
            hi = [
                min(a + n, o + m)
                for a, n, o, m in zip(offsets, dest.shape, piece.offsets, piece.shape, strict=True)
            ]
            if any(h <= low for low, h in zip(lo, hi, strict=True)):
                continue
            src = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, piece.offsets, strict=True))
            dst = tuple(slice(low - a, h - a) for low, h, a in zip(lo, hi, offsets, strict=True))
            handle = self._open(piece.file)
            try:
                part_slice = handle.get_slice(name)
                stored = tuple(part_slice.get_shape())
                part = handle.get_tensor(name) if not lo else part_slice[src]
            except Exception as exc:  # a checksummed-but-crafted file: parsing may raise anything
                raise CheckpointError(
                    piece.file, f"cannot read {name!r}: {type(exc).__name__}: {exc}"
                ) from exc
            if stored != piece.shape or part.dtype != entry.dtype:
                raise CheckpointError(
                    piece.file,
                    f"{name!r} is {part.dtype} {list(stored)}, "
                    f"its index says {entry.dtype} {list(piece.shape)}",
                )
            with torch.no_grad():
                dest[dst].copy_(part)
            copied += part.numel()
        if copied != dest.numel():
            raise CheckpointError(
                entry.index, f"the slices of {name!r} cover {copied} of {dest.numel()} elements"
            )


def load_sharded(
    directory: str | Path,
    targets: Mapping[str, torch.Tensor],
    *,
    rank: int,
    world_size: int,
    strict: bool = False,
) -> dict[str, Any]:
    """Fill every tensor of ``targets`` in place from the checkpoint in ``directory``; returns its meta.

    A DTensor target receives its local slice (offsets from its mesh and placements, so a
    checkpoint saved on any number of ranks loads on any other); a plain tensor the whole
    tensor. Only the files holding needed slices are read: each once in full for its sha256,
    then the needed slices. ``rank`` and ``world_size`` are the caller's (checked, logged); the
    slices come from each target itself. Needs no process group and runs no collective.
    Raises :class:`CheckpointError` naming the file for a missing, corrupt or inconsistent
    file, for a target the checkpoint does not hold or holds with another shape or dtype, and
    with ``strict`` for tensors the checkpoint holds that ``targets`` lack.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    ckpt = _Checkpoint(directory)
    _fill_targets(ckpt, targets, strict=strict)
    logger.debug("rank %d of %d loaded %d tensors from %s", rank, world_size, len(targets), ckpt.root)
    return ckpt.meta


def _fill_targets(
    ckpt: _Checkpoint, targets: Mapping[str, torch.Tensor], *, strict: bool, ignore: tuple[str, ...] = ()
) -> None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    index_path = ckpt.root / INDEX_NAME
    held = {name for name in ckpt.entries if not name.startswith(ignore)}
    if strict and (extra := sorted(held - set(targets))):
        raise CheckpointError(index_path, f"holds {len(extra)} tensors nothing loads, e.g. {extra[:3]}")
    for name, target in targets.items():
        entry = ckpt.entries.get(name)
        if entry is None:
            raise CheckpointError(index_path, f"holds no tensor {name!r}")
        shape = tuple(int(s) for s in target.shape)
        if (entry.shape, entry.dtype) != (shape, target.dtype):
            raise CheckpointError(
                entry.index,
                f"{name!r} is {entry.dtype} {list(entry.shape)}, the target is {target.dtype} {list(shape)}",
            )
        if isinstance(target, DTensor):
            if target.device_mesh.get_coordinate() is None:
                continue
            _, offsets = compute_local_shape_and_global_offset(
                target.shape, target.device_mesh, target.placements
            )
            ckpt.fill(name, target.to_local(), tuple(int(o) for o in offsets))
        else:
            ckpt.fill(name, target, (0,) * len(shape))


def iter_full_tensors(directory: str | Path, *, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of the checkpoint whose name starts with ``prefix``
    (``"model."``: the weights, no optimizer state), whole and on CPU, one at a time, in the
    order they were saved.

    Needs no process group; memory is one whole tensor at a time. Every index is checked
    before the first tensor comes out, each data file before it is first read.
    """
    ckpt = _Checkpoint(directory)
    for name, entry in ckpt.entries.items():
        if not name.startswith(prefix):
            continue
        full = torch.empty(entry.shape, dtype=entry.dtype)
        ckpt.fill(name, full, (0,) * len(entry.shape))
        yield name, full


def read_meta(directory: str | Path) -> dict[str, Any]:
    """The ``meta`` a finished checkpoint was saved with (every index checked, no data read)."""
    return _Checkpoint(directory).meta


_LORA_KEY = "lora"


def sharded_checkpoint_lora(directory: str | Path) -> dict[str, Any] | None:
    """The LoRA settings a checkpoint of a LoRA model was saved with
    (:func:`gymbridge.generation.lora.lora_settings`, which ``apply_lora`` takes back), or ``None`` for
    a checkpoint of a whole model. Every index is checked, no data read."""
    return _lora_meta(Path(directory) / INDEX_NAME, read_meta(directory))


def _lora_meta(where: Path, meta: Mapping[str, Any]) -> dict[str, Any] | None:
    settings = meta.get(_LORA_KEY)
    if settings is None:
        return None
    from gymbridge.generation.lora import ADAPTER_STRUCTURE

    if not isinstance(settings, dict) or any(k not in settings for k in ADAPTER_STRUCTURE):
        raise CheckpointError(where, f"malformed LoRA settings: {settings!r}")
    return dict(settings)


def _check_lora(where: Path, saved: dict[str, Any] | None, model: torch.nn.Module) -> None:
    """Refuse a checkpoint whose adapters (or their absence) differ from ``model``'s."""
    from gymbridge.generation.lora import lora_settings, settings_differ

    own = lora_settings(model)
    if saved is None and own is None:
        return
    if saved is None or own is None:
        held = "LoRA adapters only" if saved is not None else "a whole model, no LoRA adapters"
        wanted = "has LoRA adapters" if own is not None else "has no LoRA adapters"
        raise CheckpointError(where, f"holds {held}, and the model to load {wanted}")
    differ = settings_differ(saved, own)
    if differ:
        shown = ", ".join(f"{k} {saved.get(k)!r} saved, {own.get(k)!r} here" for k in differ)
        raise CheckpointError(where, f"holds other LoRA adapters than the model's: {shown}")


# ---------------------------------------------------------------------------- model + optimizer
def flatten_model_and_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and JSON meta of ``model`` and ``optimizer`` for :func:`save_sharded`.

    Tensors are ``model.<fqn>`` (parameters and persistent buffers) and ``optim.<fqn>.<key>``
    (e.g. ``exp_avg``), DTensors for an FSDP2 model, sharing storage with the live state.
    ``meta["optimizer"]`` holds the param groups (params as FQNs) and each parameter's
    scalar state (AdamW's 0-dim ``step`` tensor, recorded with its dtype). An optimizer that
    has not stepped yet is given its zero state first (``get_state_dict`` does so). A LoRA
    model gives only its published tensors (:func:`gymbridge.generation.lora.published_names`) and
    ``meta["lora"]``, its adapter settings.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    from gymbridge.generation.lora import lora_settings, published_names

    state_dicts: Any = get_state_dict(model, optimizer)  # its declared value union admits no indexing
    model_sd: dict[str, torch.Tensor] = state_dicts[0]
    optim_sd: dict[str, Any] = state_dicts[1]
    keep = published_names(model)
    tensors: dict[str, torch.Tensor] = {
        f"model.{k}": v for k, v in model_sd.items() if keep is None or k in keep
    }
    scalars: dict[str, dict[str, Any]] = {}
    for fqn, state in optim_sd["state"].items():
        for key, value in state.items():
            if _is_meta_scalar(value, DTensor):
                scalars.setdefault(str(fqn), {})[key] = {
                    "tensor": str(value.dtype).removeprefix("torch."),
                    "value": value.item(),
                }
            elif isinstance(value, torch.Tensor):
                tensors[f"optim.{fqn}.{key}"] = value
            else:
                scalars.setdefault(str(fqn), {})[key] = {"value": value}
    groups = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in optim_sd["param_groups"]
    ]
    meta: dict[str, Any] = {
        "optimizer": {"format": _OPTIM_FORMAT, "scalars": scalars, "param_groups": groups}
    }
    settings = lora_settings(model)
    if settings is not None:
        meta[_LORA_KEY] = settings
    return tensors, meta


def _is_meta_scalar(value: Any, dtensor: type) -> bool:
    """A finite 0-dim plain tensor of a dtype the format names: kept in JSON, not as a tensor."""
    if not isinstance(value, torch.Tensor) or isinstance(value, dtensor) or value.dim() != 0:
        return False
    return value.dtype in _ST_DTYPES and bool(torch.isfinite(value.float()).item())


def restore_model_and_optimizer(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    source: str | Path | tuple[Mapping[str, torch.Tensor], Mapping[str, Any]],
    *,
    rank: int = 0,
    world_size: int = 1,
    other_prefixes: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Load ``model`` and ``optimizer`` from a checkpoint directory, or from ``(tensors, meta)`` as
    :func:`flatten_model_and_optimizer` made them for a model of the same sharding (copied, never
    kept); returns the meta.

    From a directory, the model may be sharded differently from the save (any world size, or
    not at all). Every model tensor must be there, and nothing but the model's and optimizer's
    tensors; the optimizer gets exactly the per-parameter state that was saved (a parameter
    that had no gradient yet gets none, as in the run that saved). :class:`CheckpointError`
    names the file (or ``<in-memory state>``) otherwise. Collective where ``set_state_dict``
    is for the model's sharding (call it on every rank); ``rank`` and ``world_size`` are the
    caller's, as for :func:`load_sharded`. A directory may also hold tensors named with one of
    ``other_prefixes`` (e.g. ``"reference."``: a KL reference saved alongside), left unread.
    A LoRA model loads only its published tensors (its base weights are left as they are), from
    a checkpoint of the same adapters (``meta["lora"]``); a LoRA checkpoint into a whole model,
    or the reverse, is refused.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    targets, _ = flatten_model_and_optimizer(model, optimizer)
    if isinstance(source, str | Path):
        ckpt = _Checkpoint(source)
        where, loaded_meta, names = ckpt.root / INDEX_NAME, ckpt.meta, set(ckpt.entries)
    else:
        where, loaded_meta, names = Path("<in-memory state>"), dict(source[1]), set(source[0])
    optim_meta = _optimizer_meta(where, loaded_meta)
    _check_lora(where, _lora_meta(where, loaded_meta), model)
    # AdamW makes a parameter's state at its first gradient: load the state the save had, no more
    tensors = {k: v for k, v in targets.items() if k.startswith("model.") or k in names}
    if isinstance(source, str | Path):
        _fill_targets(ckpt, tensors, strict=True, ignore=other_prefixes)
    else:
        _copy_targets(where, source[0], tensors)
    try:
        state: dict[str, dict[str, Any]] = {}
        for name, value in tensors.items():
            if name.startswith("optim."):
                fqn, key = name.removeprefix("optim.").rsplit(".", 1)
                state.setdefault(fqn, {})[key] = value
        groups = _add_scalars(state, optim_meta)
        # set_state_dict's declared value types are invariant dicts of a union
        model_sd: Any = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
        optim_sd: Any = {"state": state, "param_groups": groups}
        # not strict: a parameter that had no gradient yet has no optimizer state, and must not get
        # one here; every model tensor is present (filled from the checkpoint above, or given)
        options = StateDictOptions(strict=False)
        set_state_dict(
            model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options
        )
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(
            where, f"model/optimizer state does not fit: {type(exc).__name__}: {exc}"
        ) from exc
    return dict(loaded_meta)


def _add_scalars(state: dict[str, dict[str, Any]], optim_meta: dict[str, Any]) -> list[dict[str, Any]]:
    """Put the optimizer's scalar state (``step``: a 0-dim tensor or a number) into ``state`` by FQN;
    returns the param groups (``betas`` as a tuple, as AdamW keeps them)."""
    for fqn, entries in optim_meta["scalars"].items():
        for key, spec in entries.items():
            if "tensor" in spec:
                value = torch.tensor(spec["value"], dtype=_DTYPES_BY_NAME[spec["tensor"]])
            else:
                value = spec["value"]
            state.setdefault(fqn, {})[key] = value
    return [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in optim_meta["param_groups"]]


def full_optimizer_state(directory: str | Path) -> dict[str, Any]:
    """The optimizer state a checkpoint of :func:`flatten_model_and_optimizer` holds, whole, for an
    unsharded model: ``{"state": {fqn: {key: value}}, "param_groups": [...]}`` keyed by parameter
    FQN as ``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict`` takes it.

    Needs no process group; holds the whole optimizer state in host memory (a single process's
    trainer does anyway). :class:`CheckpointError` names the file of anything malformed.
    """
    ckpt = _Checkpoint(directory)
    where = ckpt.root / INDEX_NAME
    optim_meta = _optimizer_meta(where, ckpt.meta)
    state: dict[str, dict[str, Any]] = {}
    try:
        for name, entry in ckpt.entries.items():
            if not name.startswith("optim."):
                continue
            fqn, key = name.removeprefix("optim.").rsplit(".", 1)
            full = torch.empty(entry.shape, dtype=entry.dtype)
            ckpt.fill(name, full, (0,) * len(entry.shape))
            state.setdefault(fqn, {})[key] = full
        groups = _add_scalars(state, optim_meta)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(where, f"malformed optimizer state: {type(exc).__name__}: {exc}") from exc
    return {"state": state, "param_groups": groups}


def _copy_targets(
    where: Path, given: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor]
) -> None:
    """Copy ``given`` into ``targets`` (same names, shapes and dtypes) or raise naming ``where``."""
    if extra := sorted(set(given) - set(targets)):
        raise CheckpointError(where, f"holds {len(extra)} tensors nothing loads, e.g. {extra[:3]}")
    for name, target in targets.items():
        value = given.get(name)
        if value is None:
            raise CheckpointError(where, f"holds no tensor {name!r}")
        if (value.shape, value.dtype) != (target.shape, target.dtype):
            raise CheckpointError(
                where,
                f"{name!r} is {value.dtype} {list(value.shape)}, "
                f"the target is {target.dtype} {list(target.shape)}",
            )
        try:
            with torch.no_grad():
                target.copy_(value)
        except RuntimeError as exc:  # e.g. a plain tensor for a DTensor target
            raise CheckpointError(where, f"cannot copy {name!r}: {exc}") from exc


def _optimizer_meta(where: Path, meta: Mapping[str, Any]) -> dict[str, Any]:
    try:
        optim_meta = meta["optimizer"]
        if optim_meta["format"] != _OPTIM_FORMAT:
            raise ValueError(f"optimizer format {optim_meta['format']!r}, expected {_OPTIM_FORMAT!r}")
        if not isinstance(optim_meta["scalars"], dict) or not isinstance(optim_meta["param_groups"], list):
            raise TypeError("scalars is not an object or param_groups not a list")
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(where, f"no model/optimizer meta: {type(exc).__name__}: {exc}") from exc
    return dict(optim_meta)
