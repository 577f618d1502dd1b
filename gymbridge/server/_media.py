"""Media by reference in the agent: inline media become media-store references, once.

A Responses-API conversation is stateless: every model call re-sends the whole
conversation, so with inline ``data:`` URLs turn t of an episode carries every image of
turns 1..t and the bytes an episode sends to the model server grow with the square of
its turns. :class:`MediaReferencer` turns each inline medium into an ordinary ``http``
URL on a gymbridge media server (``<media_store_url>/media/<content key>``, see
:mod:`gymbridge.media.store`), so each image crosses the agent -> model boundary as its
bytes once (the model server fetches it once, by key) and as a ~100-byte URL afterwards.

Invariants:

* the items given are never mutated: a changed part is a new dict in a new list;
  everything that is not an inline medium (text, http URLs, references, token fields,
  unknown items) is passed through as the same object;
* a medium is replaced only when its bytes are stored: the store answers the upload
  with the content key the bytes hash to (:func:`gymbridge.media.hashing.content_key`);
  a different key (the reference would name other bytes) or a refused upload is an
  :class:`~gymbridge.errors.EnvServerError`, an unreachable or slow store an
  ``EnvTransportError`` / ``EnvTimeoutError``. So the model server decodes exactly the
  bytes it would have decoded inline, and the content keys are the same with
  references on or off;
* each distinct content key is uploaded at most once per referencer (``HEAD`` first: a
  medium the bridge or another agent already stored is not sent again);
* inline media are found and replaced by :func:`gymbridge.protocol.replace_media_sources`
  (the bridge's rows use the same rule), which reads parts with ``media_ref_of_part``, the
  rule the model server and the trajectory layer read media with: ``input_image`` /
  ``input_audio`` / ``input_video`` (and their chat spellings) in message content and in
  ``function_call_output.output`` part lists. A tool output that *is* a bare data URL
  string stays inline (a bare http URL there would read as text, not media).

:meth:`MediaReferencer.size_of` gives the encoded size behind a reference this referencer
made, what the ``model_request`` payload boundary counts as a reference's media bytes
(:func:`gymbridge.metrics.payload_stats` ``media_size``).
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp

from gymbridge.errors import EnvServerError, EnvTimeoutError, EnvTransportError, MediaError
from gymbridge.media.hashing import content_key
from gymbridge.media.refs import DataRef, decode_data_payload, parse_ref
from gymbridge.media.store import MEDIA_PATH_PREFIX
from gymbridge.protocol import inline_media_sources, replace_media_sources

__all__ = ["MediaReferencer"]

logger = logging.getLogger(__name__)

_MAX_INLINE_BYTES = 256 * 1024 * 1024
"""The largest inline medium the agent decodes to store (a bigger one stays inline)."""


class MediaReferencer:
    """Replace inline media of conversation items with references on one media store.

    ``store_url`` is the media server's base URL (``http://127.0.0.1:PORT``); uploads go
    to ``PUT <store_url>/media/<key>`` with ``client`` (the agent's session).
    """

    def __init__(self, store_url: str, *, timeout_s: float = 60.0, max_known: int = 1_000_000) -> None:
        self.store_url = store_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_known = max_known
        self._known: dict[str, int] = {}
        """Content key -> encoded bytes stored under it (what a reference to it stands for)."""
        self.uploads = 0
        """Media bodies actually sent to the store (a key the store had already is not sent)."""
        self.upload_bytes = 0

    def url_for(self, key: str) -> str:
        return f"{self.store_url}{MEDIA_PATH_PREFIX}{key}"

    def size_of(self, key: str) -> int | None:
        """The encoded bytes behind a reference to ``key`` this referencer made (``None``: unknown)."""
        return self._known.get(key)

    async def _store(self, client: aiohttp.ClientSession, raw: bytes, key: str) -> None:
        url = self.url_for(key)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with client.head(url, timeout=timeout) as head:
                if head.status == 200 and head.headers.get("ETag") == f'"{key}"':
                    return  # stored already (the store's ETag is the key)
            async with client.put(
                url, data=raw, timeout=timeout, headers={"Content-Type": "application/octet-stream"}
            ) as reply:
                text = await reply.text()
                if reply.status not in (200, 201):
                    raise EnvServerError(
                        f"media store {self.store_url} refused an upload: HTTP {reply.status}: {text[:500]}",
                        status=reply.status,
                        body=text[:2000],
                        server=self.store_url,
                    )
                if text.strip() != key:
                    raise EnvServerError(
                        f"media store {self.store_url} stored {len(raw)} bytes under {text.strip()[:80]!r}, "
                        f"not their content key {key}",
                        status=reply.status,
                        body=text[:2000],
                        server=self.store_url,
                    )
        except TimeoutError as exc:
            raise EnvTimeoutError(
                f"media store {self.store_url}: upload timed out", server=self.store_url
            ) from exc
        except aiohttp.ClientError as exc:
            raise EnvTransportError(
                f"media store {self.store_url} unreachable: {exc}", server=self.store_url
            ) from exc
        self.uploads += 1
        self.upload_bytes += len(raw)

    async def reference(self, client: aiohttp.ClientSession, data_url: str) -> str | None:
        """The reference for ``data_url`` (its bytes stored first), or ``None`` to keep it inline."""
        try:
            ref = parse_ref(data_url)
            if not isinstance(ref, DataRef):
                return None
            raw = decode_data_payload(ref, max_bytes=_MAX_INLINE_BYTES, source=data_url)
        except MediaError as exc:
            logger.debug("keeping an inline medium inline (%s)", exc)
            return None  # the model server refuses it with its own, precise error
        key = content_key(raw)
        if key not in self._known:
            await self._store(client, raw, key)
            if len(self._known) >= self.max_known:
                self._known.clear()  # only an upload-saving memo: forgetting costs one HEAD
            self._known[key] = len(raw)
        return self.url_for(key)

    async def items(self, client: aiohttp.ClientSession, items: list[Any]) -> list[Any]:
        """``items`` with their inline media referenced (the same list when none changed)."""
        references: dict[str, str] = {}
        tried: set[str] = set()
        for url in inline_media_sources(items):
            if url not in tried:
                tried.add(url)
                reference = await self.reference(client, url)
                if reference is not None:
                    references[url] = reference
        return replace_media_sources(items, references) if references else items
