"""Reading local media files under ``MediaPolicy.allowed_local_roots``.

Invariants:

* with no allowed root (the default) every local path is refused;
* the path is resolved with ``os.path.realpath`` (symlinks and ``..``) and must
  then lie inside the realpath of one allowed root — a symlink that escapes a
  root is refused even when the link itself sits inside it;
* only regular files are read (a FIFO, device or directory is refused; the file
  is opened non-blocking so a FIFO cannot hang the open), and at most
  ``max_encoded_bytes`` are read — the size is checked from ``fstat`` first;
* on Linux the opened descriptor is checked again (``/proc/self/fd``), so a path
  swapped between the check and the open cannot escape the root;
* a missing or unreadable file is ``MediaFetchError(retryable=False)``.
"""

from __future__ import annotations

import os
import stat

from gymbridge.errors import MediaFetchError, MediaPolicyError
from gymbridge.media.policy import MediaPolicy
from gymbridge.media.refs import shorten

__all__ = ["read_local", "resolve_local"]


def resolve_local(path: str, policy: MediaPolicy, source: str) -> str:
    """The resolved path of ``path`` when it lies under an allowed root; else ``MediaPolicyError``."""
    short = shorten(source)
    if not policy.allowed_local_roots:
        raise MediaPolicyError(
            f"local file {short!r} refused: allowed_local_roots is empty (no local path is allowed)",
            source=short,
        )
    try:
        real = os.path.realpath(path)
        if _under_a_root(real, policy):
            return real
    except (OSError, ValueError) as exc:
        raise MediaPolicyError(f"local file {short!r} cannot be resolved: {exc}", source=short) from exc
    roots = [str(r) for r in policy.allowed_local_roots]
    raise MediaPolicyError(
        f"local file {short!r} resolves to {real!r}, outside every allowed_local_roots {roots}",
        source=short,
    )


def _under_a_root(real: str, policy: MediaPolicy) -> bool:
    for root in policy.allowed_local_roots:
        real_root = os.path.realpath(root)
        if os.path.commonpath([real, real_root]) == real_root:
            return True
    return False


def _recheck_opened(fd: int, real: str, policy: MediaPolicy, source: str) -> None:
    """Check the file actually opened (Linux ``/proc/self/fd``) is still under a root.

    Closes the gap between ``realpath`` and ``open``: a directory or link swapped in
    between would make the descriptor point elsewhere. Where ``/proc`` is missing the
    pre-open check stands alone.
    """
    try:
        opened = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return
    if opened != real and not _under_a_root(opened, policy):
        short = shorten(source)
        raise MediaPolicyError(
            f"local file {short!r} changed while being opened: it now resolves to {opened!r}, "
            "outside every allowed_local_roots",
            source=short,
        )


def read_local(path: str, policy: MediaPolicy, source: str) -> bytes:
    """Read the file at ``path`` under ``policy`` (see the module docstring)."""
    short = shorten(source)
    real = resolve_local(path, policy, source)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError as exc:
        raise MediaFetchError(f"local file {short!r} does not exist", source=short, retryable=False) from exc
    except OSError as exc:
        raise MediaFetchError(
            f"local file {short!r} cannot be opened: {exc.strerror}", source=short, retryable=False
        ) from exc
    try:
        _recheck_opened(fd, real, policy, source)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise MediaPolicyError(f"local file {short!r} is not a regular file", source=short)
        if info.st_size > policy.max_encoded_bytes:
            raise MediaPolicyError(
                f"local file {short!r} has {info.st_size} bytes, "
                f"over max_encoded_bytes={policy.max_encoded_bytes}",
                source=short,
            )
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(policy.max_encoded_bytes + 1)
    except OSError as exc:
        raise MediaFetchError(
            f"local file {short!r} cannot be read: {exc.strerror}", source=short, retryable=False
        ) from exc
    finally:
        os.close(fd)
    if len(raw) > policy.max_encoded_bytes:  # the file grew after fstat
        raise MediaPolicyError(
            f"local file {short!r} is over max_encoded_bytes={policy.max_encoded_bytes}", source=short
        )
    return raw
