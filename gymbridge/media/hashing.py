"""Content keys: the hex SHA-256 of a media item's **encoded** bytes.

The key identifies content, not a reference: the same bytes reached through a
data URL, a file and a URL share one key, so the tensor layer can process and
store them once. Invariant: ``content_key(b) == hashlib.sha256(b).hexdigest()``
(64 lower-case hex characters); it never depends on decoding.
"""

from __future__ import annotations

import hashlib

__all__ = ["content_key"]


def content_key(raw: bytes) -> str:
    """Hex SHA-256 digest of ``raw``."""
    return hashlib.sha256(raw).hexdigest()
