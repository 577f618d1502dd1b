"""Safe on-disk state: atomic writes and checkpoints that cannot run code when loaded.

Two pieces, for everything gymbridge writes to disk and reads back (run
checkpoints):

* :func:`write_atomic` writes a file through a temporary file in the same directory
  (flush + fsync + ``os.replace`` + directory fsync): a crash mid-write leaves whatever
  was at the path before intact. A save killed hard (``SIGKILL``, power loss) can leave
  its temporary file behind: a process's first :func:`write_atomic` into a directory removes
  the stale temporary files there of writers that are gone (one listing per directory per
  process, so a folder of 10,000 step files costs one scan, not one a write), and every
  :func:`load_state` of a path removes that path's (:func:`remove_stale_temps`).
* :func:`save_state` / :func:`load_state` store ``dict[str, torch.Tensor]`` plus a
  JSON-able ``meta`` dict as one **safetensors** file (tensors as raw little-endian bytes,
  ``meta`` as a JSON string in the safetensors ``__metadata__`` header) with a **sha256**
  of the whole file in that header. Nothing is ever unpickled, so a crafted file cannot
  run code; the checksum refuses truncated, bit-flipped or edited files.

File layout (a standard safetensors file; ``safetensors.safe_open`` reads it)::

    u64 header length N | header JSON (N bytes) | tensor bytes
    header["__metadata__"] = {"gymbridge.format": "gymbridge-state/1",
                              "gymbridge.meta": "<meta as JSON>",
                              "gymbridge.sha256": "<64 hex>"}

The digest is the sha256 of the whole file with the 64 digest characters replaced by
``0`` s (the digest has a fixed width, so writing it changes no offset).

Invariants:

* :func:`load_state` raises :class:`~gymbridge.errors.CheckpointError` (``path`` and
  ``reason`` set) for every unusable file: missing, unreadable, truncated, any flipped
  bit, a foreign or future format, malformed JSON. No other exception escapes it.
* the checksum detects accidents, not an attacker (who can recompute it); safety against a
  hostile file comes from the format: safetensors and JSON parsing only, with the JSON
  nesting depth of ``meta`` bounded by :data:`MAX_META_DEPTH`.
* :func:`save_state` never mutates the caller's tensors; tensors are written from CPU,
  contiguous copies where needed; aliasing tensors (views of one storage) are stored as
  independent copies.
* stale-temp cleanup never removes the temporary file of a save still running: temporary
  names carry the writer's pid, and files of live processes (other than finished saves of
  this one) are kept. This assumes one host writes a given directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import struct
import tempfile
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from gymbridge.errors import CheckpointError

logger = logging.getLogger(__name__)

__all__ = [
    "MAX_META_DEPTH",
    "STATE_FORMAT",
    "load_state",
    "remove_stale_temps",
    "save_state",
    "verify_state",
    "write_atomic",
]

STATE_FORMAT = "gymbridge-state/1"
"""The ``gymbridge.format`` value :func:`save_state` writes and :func:`load_state` accepts."""

MAX_META_DEPTH = 64
"""Deepest JSON nesting accepted in ``meta`` (a deeper crafted file is refused, never recursed into)."""

_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own header limit
_DIGEST_KEY = "gymbridge.sha256"
_ZERO_DIGEST = "0" * 64
_DIGEST_FIELD = re.compile(rb'"gymbridge\.sha256":"([0-9a-f]{64})"')

# temp names: ".<target>.<pid>.<random>.tmp"; the pid lets a later save tell a dead writer's file
_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.[^.]+\.tmp$")
_LEGACY_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.[A-Za-z0-9_]{8}\.tmp$")  # mkstemp names of older saves
_active_lock = threading.Lock()
_active_temps: set[str] = set()


# ---------------------------------------------------------------------------- atomic writes
def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OSError:
        return False
    return True


def remove_stale_temps(path: str | Path) -> int:
    """Remove temporary files of killed saves of ``path``; returns how many bytes were freed.

    A temp file is stale when its writer process is gone, or it is this process's and no
    save is writing it any more; temp files of older gymbridge versions (no pid) are stale.
    """
    target = Path(path)
    try:
        entries = list(target.parent.iterdir())
    except OSError:
        return 0
    freed = 0
    me = os.getpid()
    for entry in entries:
        m = _TEMP_RE.match(entry.name)
        if m is not None and m["name"] == target.name:
            pid = int(m["pid"])
            with _active_lock:
                busy = str(entry) in _active_temps
            if busy or (pid != me and _pid_alive(pid)):
                continue
        else:
            legacy = _LEGACY_TEMP_RE.match(entry.name)
            if legacy is None or legacy["name"] != target.name:
                continue
        freed += _remove_temp(entry)
    return freed


def _remove_temp(entry: Path) -> int:
    """Remove the stale temp file ``entry`` (logged); returns its size (0 when it could not be)."""
    try:
        size = entry.stat().st_size
        entry.unlink()
    except OSError:
        return 0
    logger.warning("removed stale temporary file %s (%d bytes) of an interrupted save", entry, size)
    return size


_swept: set[str] = set()
"""Directories this process has swept for stale temp files (:func:`_sweep_once`)."""


def _sweep_once(directory: Path) -> None:
    """Remove the temp files in ``directory`` whose writer process is gone, the first time this
    process writes there (temp files of this process are removed by the save that made them)."""
    key = str(directory.resolve())
    with _active_lock:
        if key in _swept:
            return
        _swept.add(key)
    try:
        entries = list(directory.iterdir())
    except OSError:
        return
    me = os.getpid()
    for entry in entries:
        m = _TEMP_RE.match(entry.name)
        if m is None or int(m["pid"]) == me or _pid_alive(int(m["pid"])):
            continue
        _remove_temp(entry)


def write_atomic(path: str | Path, chunks: Iterable[bytes]) -> None:
    """Write ``chunks`` to ``path`` atomically (temp file in the same directory + fsync + ``os.replace``).

    If anything fails before the rename (including the ``chunks`` iterable itself), the temp
    file is removed and whatever was at ``path`` before is untouched. The first write of this
    process into ``path``'s directory removes the stale temp files there (module docstring).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    _sweep_once(target.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp", dir=target.parent)
    with _active_lock:
        _active_temps.add(tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    finally:
        with _active_lock:
            _active_temps.discard(tmp)
    try:  # make the rename itself durable
        dir_fd = os.open(target.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


# ---------------------------------------------------------------------------- state files
def _json_depth_ok(text: str, limit: int) -> bool:
    """True when the JSON text nests at most ``limit`` arrays/objects (strings are skipped)."""
    depth = 0
    in_string = False
    escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def _cpu_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, non-aliasing tensors for safetensors (which refuses shared storage)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {type(name).__name__}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{name!r}] is a {type(t).__name__}, not a torch.Tensor")
        flat = t.detach()
        if flat.device.type != "cpu":
            flat = flat.cpu()
        flat = flat.contiguous()
        if flat.numel():
            ptr = flat.untyped_storage().data_ptr()
            if ptr in seen:
                flat = flat.clone()
            else:
                seen.add(ptr)
        out[name] = flat
    return out


def encode_state(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> bytes:
    """The bytes :func:`save_state` writes (see the module docstring for the layout)."""
    from safetensors.torch import save as st_save

    meta_json = json.dumps(dict(meta), ensure_ascii=True, separators=(",", ":"))
    if not _json_depth_ok(meta_json, MAX_META_DEPTH):
        raise ValueError(f"meta nests deeper than {MAX_META_DEPTH} levels")
    header_meta = {"gymbridge.format": STATE_FORMAT, "gymbridge.meta": meta_json, _DIGEST_KEY: _ZERO_DIGEST}
    data = bytearray(st_save(_cpu_tensors(tensors), metadata=header_meta))
    n = struct.unpack_from("<Q", data, 0)[0]
    fields = list(_DIGEST_FIELD.finditer(data, 8, 8 + n))
    if len(fields) != 1:  # cannot happen: meta is escaped inside a JSON string
        raise RuntimeError("safetensors header does not hold exactly one digest field")
    start = fields[0].start(1)
    data[start : start + 64] = hashlib.sha256(data).hexdigest().encode()
    return bytes(data)


def save_state(path: str | Path, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> int:
    """Write ``tensors`` and the JSON-able ``meta`` to ``path`` atomically; returns the file size in bytes.

    ``meta`` must be JSON-serialisable (tuples come back as lists); a value that is not
    raises ``TypeError``. Tensors of any dtype and device are stored from CPU copies.
    """
    data = encode_state(tensors, meta)
    write_atomic(path, [data])
    return len(data)


def decode_state(
    raw: bytes, *, path: str | Path = "<bytes>"
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Parse the bytes of a state file; raises :class:`CheckpointError` for anything unusable."""

    def fail(reason: str) -> CheckpointError:
        return CheckpointError(path, reason)

    if len(raw) < 8:
        raise fail(f"truncated: {len(raw)} bytes, not even a header length")
    n = struct.unpack_from("<Q", raw, 0)[0]
    if n > _MAX_HEADER_BYTES or 8 + n > len(raw):
        raise fail(f"truncated or not a state file: header length {n} for a {len(raw)}-byte file")
    fields = list(_DIGEST_FIELD.finditer(raw, 8, 8 + n))
    if len(fields) != 1:
        raise fail("no gymbridge sha256 in the header (not a gymbridge state file, or corrupt)")
    stored = fields[0].group(1).decode()
    h = hashlib.sha256()
    start = fields[0].start(1)
    h.update(memoryview(raw)[:start])
    h.update(_ZERO_DIGEST.encode())
    h.update(memoryview(raw)[start + 64 :])
    if h.hexdigest() != stored:
        raise fail("sha256 mismatch: the file is corrupt (flipped bits, truncated or edited)")
    try:
        header = json.loads(raw[8 : 8 + n])
        info = header["__metadata__"]
        fmt = info.get("gymbridge.format")
        if fmt != STATE_FORMAT:
            raise fail(f"format {fmt!r}, expected {STATE_FORMAT!r}")
        meta_json = info["gymbridge.meta"]
        if not isinstance(meta_json, str) or not _json_depth_ok(meta_json, MAX_META_DEPTH):
            raise fail(f"meta is not a JSON string nesting at most {MAX_META_DEPTH} levels")
        meta = json.loads(meta_json)
        if not isinstance(meta, dict):
            raise fail(f"meta is a {type(meta).__name__}, not an object")
        from safetensors.torch import load as st_load

        tensors = st_load(raw)
    except CheckpointError:
        raise
    except Exception as exc:  # a checksummed-but-crafted file: parsing may raise anything
        raise fail(f"malformed: {type(exc).__name__}: {exc}") from exc
    return tensors, meta


def load_state(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, meta)`` of a file written by :func:`save_state`.

    Raises :class:`CheckpointError` (with ``path`` and ``reason``) when the file is missing,
    unreadable, truncated, corrupt or of another format. Stale temp files of interrupted
    saves of ``path`` are removed first.
    """
    remove_stale_temps(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise CheckpointError(path, f"cannot read: {exc.strerror or exc}") from exc
    return decode_state(raw, path=path)


def verify_state(path: str | Path, *, chunk_bytes: int = 8 << 20) -> dict[str, Any]:
    """The ``meta`` of the state file at ``path`` after the checks :func:`load_state` makes (sha256,
    format, meta nesting), reading the file in chunks of ``chunk_bytes``: its tensors are not
    loaded (read them after, e.g. with ``safetensors.safe_open``).

    Raises :class:`CheckpointError` for anything :func:`load_state` refuses.
    """
    try:
        with Path(path).open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(path, f"truncated: {len(head)} bytes, not even a header length")
            (n,) = struct.unpack("<Q", head)
            size = Path(path).stat().st_size
            if n > _MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(
                    path, f"truncated or not a state file: header length {n} for a {size}-byte file"
                )
            header = f.read(n)
            fields = list(_DIGEST_FIELD.finditer(header))
            if len(fields) != 1:
                raise CheckpointError(
                    path, "no gymbridge sha256 in the header (not a gymbridge state file, or corrupt)"
                )
            stored = fields[0].group(1).decode()
            start = fields[0].start(1)
            h = hashlib.sha256(head)
            h.update(header[:start])
            h.update(_ZERO_DIGEST.encode())
            h.update(header[start + 64 :])
            while chunk := f.read(chunk_bytes):
                h.update(chunk)
    except OSError as exc:
        raise CheckpointError(path, f"cannot read: {exc.strerror or exc}") from exc
    if h.hexdigest() != stored:
        raise CheckpointError(
            path, "sha256 mismatch: the file is corrupt (flipped bits, truncated or edited)"
        )
    try:
        info = json.loads(header)["__metadata__"]
        fmt = info.get("gymbridge.format")
        if fmt != STATE_FORMAT:
            raise CheckpointError(path, f"format {fmt!r}, expected {STATE_FORMAT!r}")
        meta_json = info["gymbridge.meta"]
        if not isinstance(meta_json, str) or not _json_depth_ok(meta_json, MAX_META_DEPTH):
            raise CheckpointError(path, f"meta is not a JSON string nesting at most {MAX_META_DEPTH} levels")
        meta = json.loads(meta_json)
        if not isinstance(meta, dict):
            raise CheckpointError(path, f"meta is a {type(meta).__name__}, not an object")
    except CheckpointError:
        raise
    except Exception as exc:  # a checksummed-but-crafted header: parsing may raise anything
        raise CheckpointError(path, f"malformed: {type(exc).__name__}: {exc}") from exc
    return meta
