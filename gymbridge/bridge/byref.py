"""Media by reference at the Gym request: a prompt's inline media go into the store once.

Without it, the G ``/run`` rows of a prompt carry G base64 copies of every image.
:class:`RowReferencer` rewrites one dataset row: each inline medium (a ``data:`` URL in a
media part of ``responses_create_params.input``) is decoded, put into a
:class:`~gymbridge.media.MediaStore` (written once per content key) and replaced by its
reference ``<media server>/media/<key>``, an ordinary http URL that any agent or model
server can fetch; the G rows are then made from the rewritten row.

Invariants:

* the row is never mutated; a changed part is a new dict inside new lists, everything
  else (text, http URLs, unknown items and keys, token fields) is the same object;
* media parts are found with :func:`gymbridge.protocol.inline_media_sources` (built on
  ``media_ref_of_part``, the rule the model server and the trajectory layer read media
  with): parts of message ``content`` and of ``function_call_output.output`` lists. A tool
  output that *is* a bare data-URL string stays inline (a bare http URL there reads as
  text, not media), and so does
  ``metadata.audio_data`` (genuine ``vllm_model`` reads it as data URIs only);
* the reference names exactly the bytes the data URL holds (the key is their sha256), so
  whoever loads it decodes the same bytes and computes the same content key as inline;
* an inline medium that cannot be decoded (bad base64, over the policy's
  ``max_encoded_bytes``) stays inline, so it fails downstream exactly as it does without
  references.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from gymbridge.errors import MediaError
from gymbridge.media.hashing import content_key
from gymbridge.media.policy import MediaPolicy
from gymbridge.media.refs import DataRef, decode_data_payload, parse_ref
from gymbridge.media.store import MediaStore
from gymbridge.protocol import inline_media_sources, replace_media_sources

__all__ = ["RowReferencer"]

logger = logging.getLogger(__name__)


class RowReferencer:
    """Put a row's inline media into ``store``; ``url_for(key)`` makes the reference.

    ``stored`` / ``stored_bytes`` count the media put into the store (a key already there
    is not written again); ``replaced`` counts the parts rewritten.
    """

    def __init__(
        self, store: MediaStore, url_for: Callable[[str], str], *, policy: MediaPolicy | None = None
    ) -> None:
        self.store = store
        self.url_for = url_for
        self.policy = policy if policy is not None else MediaPolicy()
        self.stored = 0
        self.stored_bytes = 0
        self.replaced = 0

    def reference(self, data_url: str) -> str | None:
        """The reference for ``data_url`` (its bytes stored), or ``None`` to keep it inline."""
        try:
            ref = parse_ref(data_url)
            if not isinstance(ref, DataRef):
                return None
            raw = decode_data_payload(ref, max_bytes=self.policy.max_encoded_bytes, source=data_url)
            existed = self.store.size(content_key(raw)) == len(raw)
            key = self.store.put(raw)
        except MediaError as exc:
            logger.debug("keeping an inline medium inline (%s)", exc)
            return None
        if not existed:
            self.stored += 1
            self.stored_bytes += len(raw)
        self.replaced += 1
        return self.url_for(key)

    def row(self, row: Mapping[str, Any]) -> Mapping[str, Any]:
        """``row`` with its inline media referenced (the same object when it has none)."""
        rcp = row.get("responses_create_params")
        if not isinstance(rcp, Mapping) or not isinstance(rcp.get("input"), list):
            return row
        items = rcp["input"]
        refs: dict[str, str] = {}
        for source in inline_media_sources(items):
            if source not in refs:
                ref = self.reference(source)
                if ref is not None:
                    refs[source] = ref
        new_items = replace_media_sources(items, refs) if refs else items
        if new_items is items:
            return row
        return {**row, "responses_create_params": {**rcp, "input": new_items}}
