"""Same-host weight sync through shared memory: the trainer writes, the generator reads in place.

The trainer (:class:`SharedWeightsWriter`) creates **two** segments in ``/dev/shm``, each
holding every weight of the layout once; the generator's process maps both **read-only**
(:class:`SharedWeightsReader`). A sync writes the new version into the segment the generator
is *not* using (one copy, while generation keeps running on the other): that segment is the
sync's staging. Then the generator stages the swap with its
:class:`~gymbridge.generation.weights.WeightGate`: at its next generation boundary (at once when
idle) it points its parameters at the written segment (a pointer swap per tensor, no copy) and
takes the new version. The trainer writes the other segment next, once that swap is live (the
server's ``policy_version``), so no generation uses it any more. No bytes cross a socket and
nothing is deserialised: a segment is raw tensor bytes at offsets both sides compute from the
layout (:func:`segment_offsets`).

Handshake (what makes opening a named segment safe):

* names are ``gymbridge-weights-<32 hex>-<0|1>`` only (no path, no traversal), opened with
  ``O_NOFOLLOW`` from ``/dev/shm``; the file must be a regular file of this user, mode
  ``0600``, of exactly the layout's size;
* every segment starts with a header: magic, the 16-byte nonce the trainer sent over HTTP,
  and the SHA-256 of the layout; a generator on another host (or another ``/dev/shm``)
  finds no such file or the wrong nonce and refuses, and the trainer falls back to the
  broadcast;
* both sides map with ``MAP_POPULATE`` (the page faults of a fresh segment are paid at set-up,
  not by the first sync);
* the trainer unlinks the files once the generator has mapped them (nothing is left in
  ``/dev/shm`` after a crash past that point), and reserves their memory with
  ``posix_fallocate`` first, so a full ``/dev/shm`` is an error at set-up, not a ``SIGBUS``
  mid-sync.

Invariants: the generator never reads a segment while it is written (the trainer writes only
the segment the generator left at a swap that is live, and a swap waits for the generation in
flight); the generator's parameters over a segment are read-only memory (a stray in-place
write faults instead of corrupting the trainer's next version); CPU models only.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import re
import secrets
import stat
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from gymbridge.errors import WeightSyncError
from gymbridge.generation.weights import TensorSpec, dtype_from_name

logger = logging.getLogger(__name__)

__all__ = [
    "SHM_DIR",
    "SharedWeightsReader",
    "SharedWeightsWriter",
    "segment_offsets",
    "shared_memory_problem",
]

SHM_DIR = "/dev/shm"
MAGIC = b"GBWSHM01"
HEADER_BYTES = 64
"""Magic (8) + nonce (16) + layout SHA-256 (32) + padding: the weights start 64-byte aligned."""
ALIGN = 64
NAME = re.compile(r"^gymbridge-weights-[0-9a-f]{32}-[01]$")
COPY_THREADS = 4
PARALLEL_BYTES = 64 * 1024 * 1024
"""Segments smaller than this are written by one thread (the threads' start-up would cost more)."""
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
"""Both sides map with the page tables filled at set-up (Linux ``MAP_POPULATE``): the first sync
into a fresh segment otherwise paid a page fault per 4 KiB page (1.4-3.5 s for 400 MiB against
0.2-0.3 s for a later copy, measured under load), and the generator's first forward after the
swap paid them again."""


def _layout_digest(specs: Sequence[TensorSpec]) -> bytes:
    h = hashlib.sha256()
    for s in specs:
        h.update(f"{s.name}\0{','.join(map(str, s.shape))}\0{s.dtype}\n".encode())
    return h.digest()


def segment_offsets(specs: Sequence[TensorSpec]) -> tuple[list[int], int]:
    """Byte offset of each spec's tensor in a segment, and the segment's size (header included)."""
    offsets: list[int] = []
    at = HEADER_BYTES
    for s in specs:
        offsets.append(at)
        size = s.numel * torch.empty((), dtype=dtype_from_name(s.dtype)).element_size()
        at += -(-size // ALIGN) * ALIGN
    return offsets, max(at, HEADER_BYTES)


def _views(buffer: Any, specs: Sequence[TensorSpec], offsets: Sequence[int], size: int) -> list[torch.Tensor]:
    with warnings.catch_warnings():  # a read-only mapping: torch warns that it is not writable
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(buffer, dtype=torch.uint8, count=size)
    views = []
    for spec, offset in zip(specs, offsets, strict=True):
        dtype = dtype_from_name(spec.dtype)
        nbytes = spec.numel * torch.empty((), dtype=dtype).element_size()
        views.append(raw[offset : offset + nbytes].view(dtype).view(spec.shape))
    return views


def shared_memory_problem(nbytes: int) -> str | None:
    """Why two segments of ``nbytes`` cannot be made here (``None``: they can)."""
    if not os.path.isdir(SHM_DIR):
        return f"{SHM_DIR} does not exist on this system"
    try:
        fs = os.statvfs(SHM_DIR)
    except OSError as exc:
        return f"{SHM_DIR}: {exc}"
    free = fs.f_bavail * fs.f_frsize
    if free < 2 * nbytes:
        need = 2 * nbytes / 2**20
        return f"{SHM_DIR} has {free / 2**20:.0f} MiB free, two weight segments need {need:.0f} MiB"
    return None


class SharedWeightsWriter:
    """The trainer's two segments (see the module docstring); :meth:`write` fills one."""

    def __init__(self, specs: Sequence[TensorSpec]) -> None:
        self.specs = list(specs)
        self.offsets, self.nbytes = segment_offsets(self.specs)
        problem = shared_memory_problem(self.nbytes)
        if problem is not None:
            raise WeightSyncError(f"shared-memory weight sync unavailable: {problem}")
        self.nonce = secrets.token_bytes(16)
        stem = f"gymbridge-weights-{secrets.token_hex(16)}"
        self.names = [f"{stem}-0", f"{stem}-1"]
        self._maps: list[mmap.mmap] = []
        self._views: list[list[torch.Tensor]] = []
        self._linked: list[str] = []
        header = MAGIC + self.nonce + _layout_digest(self.specs)
        try:
            for name in self.names:
                path = os.path.join(SHM_DIR, name)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                self._linked.append(path)
                try:
                    os.posix_fallocate(fd, 0, self.nbytes)  # ENOSPC now, never SIGBUS mid-copy
                    mm = mmap.mmap(fd, self.nbytes, _MAP_FLAGS, mmap.PROT_READ | mmap.PROT_WRITE)
                finally:
                    os.close(fd)
                mm[: len(header)] = header
                self._maps.append(mm)
                self._views.append(_views(mm, self.specs, self.offsets, self.nbytes))
        except OSError as exc:
            self.close()
            raise WeightSyncError(f"could not create a shared-memory weight segment: {exc}") from exc

    def write(self, index: int, tensors: Sequence[torch.Tensor]) -> None:
        """Copy ``tensors`` (in the specs' order) into segment ``index``.

        Over ``PARALLEL_BYTES`` the copy runs on up to ``COPY_THREADS`` threads (torch releases
        the GIL while it copies), each taking every k-th tensor.
        """
        views = self._views[index]
        if len(views) != len(tensors):
            raise WeightSyncError(f"{len(tensors)} tensors for a layout of {len(views)}")
        threads = min(COPY_THREADS, os.cpu_count() or 1, len(views))

        def copy(first: int) -> None:
            with torch.no_grad():
                for i in range(first, len(views), threads):
                    views[i].copy_(tensors[i].detach())

        if threads < 2 or self.nbytes < PARALLEL_BYTES:
            threads = 1
            copy(0)
            return
        with ThreadPoolExecutor(threads, thread_name_prefix="gb-shm-copy") as pool:
            for done in [pool.submit(copy, k) for k in range(threads)]:
                done.result()

    def unlink(self) -> None:
        """Remove the files (both sides keep their mappings); idempotent."""
        for path in self._linked:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._linked = []

    def close(self) -> None:
        """Unlink and drop the mappings: each is unmapped once no tensor views it any more (never
        ``mmap.close()``: torch keeps the mapping object alive, not the mapping)."""
        self.unlink()
        self._views = []
        self._maps = []


class SharedWeightsReader:
    """The generator's read-only mappings of the trainer's two segments (module docstring)."""

    def __init__(self, names: Sequence[str], nonce: bytes, specs: Sequence[TensorSpec]) -> None:
        if len(names) != 2 or not all(isinstance(n, str) and NAME.match(n) for n in names):
            raise WeightSyncError("shared-memory segments must be two names gymbridge-weights-<32 hex>-<0|1>")
        if len(nonce) != 16:
            raise WeightSyncError("the shared-memory nonce must be 16 bytes")
        self.specs = list(specs)
        self.offsets, self.nbytes = segment_offsets(self.specs)
        header = MAGIC + nonce + _layout_digest(self.specs)
        self._maps: list[mmap.mmap] = []
        self.views: list[list[torch.Tensor]] = []
        try:
            for name in names:
                mm = self._open(name)
                self._maps.append(mm)
                if mm[: len(header)] != header:
                    raise WeightSyncError(
                        f"{name}: its header does not match the trainer's nonce and layout "
                        "(another host's or another run's segment)"
                    )
                self.views.append(_views(mm, self.specs, self.offsets, self.nbytes))
        except BaseException:
            self.close()
            raise

    def _open(self, name: str) -> mmap.mmap:
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise WeightSyncError(f"cannot open the shared-memory segment {path}: {exc}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise WeightSyncError(f"{path} is not a private regular file of this user")
            if st.st_size != self.nbytes:
                raise WeightSyncError(f"{path} holds {st.st_size} bytes, the layout needs {self.nbytes}")
            return mmap.mmap(fd, self.nbytes, _MAP_FLAGS, mmap.PROT_READ)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Drop the mappings (unmapped once no tensor of the model views them any more)."""
        self.views = []
        self._maps = []
