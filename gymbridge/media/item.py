"""``MediaItem``: one piece of media, referenced or loaded, decoded only on request.

States and invariants:

* a **lazy** item (``MediaItem.from_ref``) holds its parsed reference; the
  reference was policy-checked when the item was made (scheme, local root,
  literal private addresses, an oversize data URL), and every check runs again
  when the bytes load;
* the encoded bytes load on the first access to ``.raw`` / ``.key`` /
  ``.nbytes`` / ``.mime`` / a decoder (or ``await item.aload()``), exactly once
  even under concurrent access (a lock), and are then cached; nothing is ever
  decoded by loading;
* decoders (``.image()``, ``.audio()``, ``.video()``) decode on every call and
  cache nothing (a decoded video can be hundreds of MB; the tensor layer
  processes each content key once);
* ``key`` is the hex SHA-256 of the encoded bytes (see :mod:`.hashing`);
* pickling: a lazy item pickles its reference, a loaded item its bytes (out of
  band under pickle protocol 5; a loaded data-URL item drops the URL text — it
  would double the payload — and ``.source`` then rebuilds a canonical data URL
  with the same bytes and key);
* equality is identity; compare ``.key`` to compare content.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import threading
from typing import Any, Literal, SupportsIndex, get_args

import numpy as np
import numpy.typing as npt
from PIL import Image

from gymbridge.errors import MediaPolicyError
from gymbridge.media import decode
from gymbridge.media.fetch import afetch_http, check_url, fetch_http
from gymbridge.media.hashing import content_key
from gymbridge.media.local import read_local, resolve_local
from gymbridge.media.policy import MediaPolicy
from gymbridge.media.refs import (
    DataRef,
    FileRef,
    HttpRef,
    MediaRef,
    check_data_size,
    decode_data_payload,
    encode_data_url,
    parse_ref,
    shorten,
    sniff_mime,
)

__all__ = ["MediaItem", "Modality", "aload_media", "load_media"]

Modality = Literal["image", "audio", "video"]
_MODALITIES: tuple[str, ...] = get_args(Modality)
_DEFAULT_POLICY = MediaPolicy()


def _check_modality(modality: str) -> Modality:
    if modality not in _MODALITIES:
        raise ValueError(f"unknown modality {modality!r} (expected one of {_MODALITIES})")
    return modality  # type: ignore[return-value]  # narrowed by the membership test above


class MediaItem:
    """One image, audio clip or video; see the module docstring for its states."""

    __slots__ = (
        "__weakref__",
        "_declared_mime",
        "_key",
        "_lock",
        "_modality",
        "_policy",
        "_raw",
        "_ref",
        "_source",
    )

    def __init__(
        self,
        modality: Modality,
        *,
        source: str | None,
        ref: MediaRef | None,
        raw: bytes | None,
        declared_mime: str | None,
        policy: MediaPolicy,
    ) -> None:
        """Internal; use :meth:`from_ref`, :meth:`from_bytes` or :func:`load_media`."""
        self._modality: Modality = _check_modality(modality)
        self._source = source
        self._ref = ref
        self._raw = raw
        self._key: str | None = None
        self._declared_mime = declared_mime
        self._policy = policy
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_ref(
        cls, source: str | os.PathLike[str], modality: Modality, policy: MediaPolicy | None = None
    ) -> MediaItem:
        """A lazy item: parse and policy-check ``source`` now; read no bytes, decode nothing.

        ``source`` is a reference string; a ``pathlib.Path`` is taken as a local path.
        """
        policy = _DEFAULT_POLICY if policy is None else policy
        if isinstance(source, os.PathLike):
            source = os.fspath(source)
        _check_modality(modality)
        ref = parse_ref(source)
        if isinstance(ref, DataRef):
            check_data_size(ref, max_bytes=policy.max_encoded_bytes, source=source)
        elif isinstance(ref, FileRef):
            resolve_local(ref.path, policy, source)
        else:
            check_url(ref.url, policy, source)
        declared = ref.mime if isinstance(ref, DataRef) else None
        return cls(modality, source=source, ref=ref, raw=None, declared_mime=declared, policy=policy)

    @classmethod
    def from_bytes(
        cls,
        raw: bytes | bytearray | memoryview,
        modality: Modality,
        *,
        mime: str | None = None,
        source: str | None = None,
        policy: MediaPolicy | None = None,
    ) -> MediaItem:
        """A loaded item over ``raw`` (refused when over ``max_encoded_bytes``)."""
        policy = _DEFAULT_POLICY if policy is None else policy
        if not isinstance(raw, bytes | bytearray | memoryview):
            raise TypeError(f"raw must be bytes, got {type(raw).__name__}")
        data = bytes(raw)
        item = cls(modality, source=source, ref=None, raw=data, declared_mime=mime, policy=policy)
        if len(data) > policy.max_encoded_bytes:
            raise MediaPolicyError(
                f"{modality} {item.short_source!r} has {len(data)} bytes, "
                f"over max_encoded_bytes={policy.max_encoded_bytes}",
                source=item.short_source,
            )
        return item

    # ------------------------------------------------------------------ properties

    @property
    def modality(self) -> Modality:
        return self._modality

    @property
    def policy(self) -> MediaPolicy:
        return self._policy

    @property
    def source(self) -> str:
        """The reference this item came from (a synthetic label for in-memory bytes)."""
        if self._source is not None:
            return self._source
        if self._raw is not None and isinstance(self._ref, DataRef):
            return encode_data_url(self._raw, self._declared_mime or self.mime)
        return f"<in-memory {self._modality}, {len(self._raw or b'')} bytes>"

    @property
    def short_source(self) -> str:
        """``source`` shortened for messages (first 60 characters and the length)."""
        if self._source is None and isinstance(self._ref, DataRef):
            return shorten(f"data:{self._declared_mime or ''};base64,…")
        return shorten(self.source)

    @property
    def loaded(self) -> bool:
        """Whether the encoded bytes are in memory."""
        return self._raw is not None

    @property
    def raw(self) -> bytes:
        """The encoded bytes; loaded (and policy-checked) on first access."""
        raw = self._raw
        if raw is None:
            with self._lock:
                if self._raw is None:
                    self._raw = self._read_sync()
                raw = self._raw
        return raw

    @property
    def key(self) -> str:
        """Hex SHA-256 of the encoded bytes."""
        if self._key is None:
            self._key = content_key(self.raw)
        return self._key

    @property
    def nbytes(self) -> int:
        return len(self.raw)

    @property
    def mime(self) -> str:
        """MIME type sniffed from the bytes; else the declared one; else ``application/octet-stream``."""
        return sniff_mime(self.raw) or self._declared_mime or "application/octet-stream"

    # ------------------------------------------------------------------ loading

    def _read_sync(self) -> bytes:
        ref = self._ref
        assert ref is not None, "an item without bytes always has a reference"
        source = self.source
        if isinstance(ref, DataRef):
            return decode_data_payload(ref, max_bytes=self._policy.max_encoded_bytes, source=source)
        if isinstance(ref, FileRef):
            return read_local(ref.path, self._policy, source)
        return fetch_http(ref.url, self._policy)

    async def aload(self) -> MediaItem:
        """Load the bytes without blocking the event loop (async fetch for URLs); returns ``self``."""
        if self._raw is not None:
            return self
        ref = self._ref
        if isinstance(ref, HttpRef):
            raw = await afetch_http(ref.url, self._policy)
        else:
            raw = await asyncio.to_thread(self._read_sync)
        with self._lock:
            if self._raw is None:
                self._raw = raw
        return self

    # ------------------------------------------------------------------ decoding

    def probe(self) -> decode.ImageHeader | decode.AudioHeader | decode.VideoHeader:
        """Header-only check (format, size, duration) against the policy; decodes no pixels."""
        return decode.probe(self.raw, self._modality, self._policy, self.short_source)

    def _require(self, modality: Modality) -> None:
        if self._modality != modality:
            raise TypeError(f"{self!r} is {self._modality}, not {modality}")

    def image(self) -> Image.Image:
        """Decoded RGB ``PIL.Image`` (EXIF orientation applied); decodes on every call."""
        self._require("image")
        return decode.decode_image(self.raw, self._policy, self.short_source)

    def audio(self) -> tuple[npt.NDArray[np.float32], int]:
        """``(float32 waveform [N] or [N, C], sample_rate)``; decodes on every call."""
        self._require("audio")
        return decode.decode_audio(self.raw, self._policy, self.short_source)

    def video(self, *, fps: float | None = None, max_frames: int | None = None) -> npt.NDArray[np.uint8]:
        """uint8 frames ``[T, H, W, 3]`` sampled at ``fps`` (default ``policy.video_fps``).

        At most ``max_frames`` (default ``policy.max_frames``) frames, spread over the whole clip.
        """
        return self.video_clip(fps=fps, max_frames=max_frames).frames

    def video_clip(self, *, fps: float | None = None, max_frames: int | None = None) -> decode.VideoClip:
        """Like :meth:`video`, with each frame's timestamp in seconds."""
        self._require("video")
        return decode.decode_video(self.raw, self._policy, self.short_source, fps=fps, max_frames=max_frames)

    def to_data_url(self) -> str:
        """``data:<mime>;base64,…`` of the encoded bytes."""
        return encode_data_url(self.raw, self.mime)

    # ------------------------------------------------------------------ pickling / repr

    def __getstate__(self) -> dict[str, Any]:
        loaded = self._raw is not None
        drop_source = loaded and isinstance(self._ref, DataRef)
        return {
            "modality": self._modality,
            "source": None if drop_source else self._source,
            "raw": self._raw,
            "key": self._key,
            "declared_mime": self._declared_mime,
            "policy": self._policy,
            "data_ref": drop_source,
        }

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        # protocol 5: the encoded bytes travel out of band (Ray / payload metrics count them
        # as buffers and can avoid a copy); older protocols pickle them in band
        state = self.__getstate__()
        if int(protocol) >= 5 and state["raw"] is not None:
            state["raw"] = pickle.PickleBuffer(state["raw"])
        return (_restore_item, (state,))

    def __setstate__(self, state: dict[str, Any]) -> None:
        raw = state["raw"]
        if raw is not None and not isinstance(raw, bytes):  # an out-of-band buffer came back
            state = {**state, "raw": bytes(raw)}
        source: str | None = state["source"]
        ref: MediaRef | None
        if state["data_ref"]:
            ref = DataRef(mime=state["declared_mime"], is_base64=True, url="", payload_offset=0)
        elif state["raw"] is None and source is not None:
            ref = parse_ref(source)
        else:
            ref = None
        self._modality = state["modality"]
        self._source = source
        self._ref = ref
        self._raw = state["raw"]
        self._key = state["key"]
        self._declared_mime = state["declared_mime"]
        self._policy = state["policy"]
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        size = f"{len(self._raw)} bytes" if self._raw is not None else "not loaded"
        return f"MediaItem({self._modality}, {self.short_source!r}, {size})"


def _restore_item(state: dict[str, Any]) -> MediaItem:
    """Unpickling entry point (see ``MediaItem.__reduce_ex__``)."""
    item = MediaItem.__new__(MediaItem)
    item.__setstate__(state)
    return item


def load_media(
    source: str | os.PathLike[str], modality: Modality, policy: MediaPolicy | None = None
) -> MediaItem:
    """Load ``source`` eagerly: bytes read and size-capped, header checked; pixels stay undecoded.

    The header check (:meth:`MediaItem.probe`) refuses unknown formats, wrong
    modalities, decompression bombs (``max_pixels`` from the declared size) and
    over-long audio / video now; corrupt pixel / sample data is found by the
    decoders (``.image()``, ``.audio()``, ``.video()``).
    """
    item = MediaItem.from_ref(source, modality, policy)
    item.probe()
    return item


async def aload_media(
    source: str | os.PathLike[str], modality: Modality, policy: MediaPolicy | None = None
) -> MediaItem:
    """Async :func:`load_media`: async fetch for URLs; file, base64 and header work in a thread."""
    item = MediaItem.from_ref(source, modality, policy)
    await item.aload()
    await asyncio.to_thread(item.probe)
    return item
