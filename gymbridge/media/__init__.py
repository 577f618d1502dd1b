"""Safe media loading: references -> policy checks -> bytes -> lazy decoders.

``gymbridge.media`` turns untrusted media references (data URLs, local files,
http(s) URLs) into :class:`MediaItem` s under a :class:`MediaPolicy`. Every
failure is a :class:`~gymbridge.errors.MediaError` subclass whose message names
the shortened source and the limit; nothing hangs (every read has a deadline or
a size bound); nothing is decoded until a decoder is called.

Modules: :mod:`.policy` (limits), :mod:`.refs` (parsing, shortening, MIME
sniffing, data URLs), :mod:`.local` (allowed roots), :mod:`.fetch` (guarded
http), :mod:`.decode` (Pillow / soundfile / PyAV), :mod:`.hashing` (content
keys), :mod:`.item` (``MediaItem``, ``load_media``), :mod:`.store` (the
content-addressed ``MediaStore`` and its HTTP ``MediaServer``: media by reference).
"""

from __future__ import annotations

from gymbridge.media.decode import AudioHeader, ImageHeader, VideoClip, VideoHeader
from gymbridge.media.fetch import afetch_http, fetch_http
from gymbridge.media.hashing import content_key
from gymbridge.media.item import MediaItem, Modality, aload_media, load_media
from gymbridge.media.policy import MediaPolicy
from gymbridge.media.refs import encode_data_url, shorten, sniff_mime
from gymbridge.media.store import MediaServer, MediaStore, parse_media_ref

__all__ = [
    "AudioHeader",
    "ImageHeader",
    "MediaItem",
    "MediaPolicy",
    "MediaServer",
    "MediaStore",
    "Modality",
    "VideoClip",
    "VideoHeader",
    "afetch_http",
    "aload_media",
    "content_key",
    "encode_data_url",
    "fetch_http",
    "load_media",
    "parse_media_ref",
    "shorten",
    "sniff_mime",
]
