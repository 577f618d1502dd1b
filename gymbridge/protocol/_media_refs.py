"""Where a media reference sits in NeMo Gym's JSON: one answer for the raw dicts and the models.

Pure functions over the raw JSON shapes (dicts and lists as parsed from the wire);
they return ``(source, modality)`` pairs in order of appearance and never touch the
bytes behind a reference (no fetching, no decoding, no base64 work). The part models
of :mod:`gymbridge.protocol._content` answer ``.source`` with the same rules
(:func:`inline_audio_url`, :data:`VIDEO_KEYS`), so a walk over raw dicts (the
trajectory postprocessor, the chat renderer) and code over parsed models agree on
every part.

Invariants:

* only parts of these types carry media: ``input_image`` / ``input_audio`` /
  ``input_video`` (Responses API, plus gymbridge's audio part) and their
  chat-completions spellings ``image_url`` / ``audio_url`` / ``video_url`` (agents
  built on chat models inject them verbatim); text and unknown parts carry none;
* a plain string ``content`` is text, never media; a ``function_call_output.output``
  string is media only when it is a ``data:`` URL whose MIME type is ``image/*``,
  ``audio/*`` or ``video/*`` (a file path, an http URL or JSON text such as
  ``{"x": 3}`` adds nothing);
* a part that claims to be media but carries no usable reference raises
  :class:`~gymbridge.errors.ProtocolError` naming the part and the reason, so an
  image is never dropped silently.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Literal

from gymbridge.errors import ProtocolError

__all__ = [
    "VIDEO_KEYS",
    "MediaRef",
    "Modality",
    "data_url_modality",
    "inline_audio_url",
    "media_ref_of_part",
    "media_refs_of_content",
    "media_refs_of_tool_output",
]

Modality = Literal["image", "audio", "video"]
#: ``(source, modality)``: the reference string (to hand to ``gymbridge.media``) and its kind.
MediaRef = tuple[str, Modality]

#: The keys of an ``input_video`` part that may hold its URL, in order of preference.
VIDEO_KEYS: tuple[str, str] = ("video_url", "video")

_MIME_MAJOR_TO_MODALITY: dict[str, Modality] = {"image": "image", "audio": "audio", "video": "video"}

# Part type -> (modality, keys that may hold its reference, in order of preference).
_MEDIA_PART_KEYS: dict[str, tuple[Modality, tuple[str, ...]]] = {
    "input_image": ("image", ("image_url", "image")),
    "image_url": ("image", ("image_url",)),
    "input_video": ("video", VIDEO_KEYS),
    "video_url": ("video", ("video_url",)),
    "input_audio": ("audio", ("audio_url", "audio", "input_audio")),
    "audio_url": ("audio", ("audio_url",)),
}


def inline_audio_url(data: str, audio_format: str) -> str:
    """A data URL for inline audio (``{"data": <base64>, "format": "wav"}``); a data URL stays as is."""
    return data if data.startswith("data:") else f"data:audio/{audio_format};base64,{data}"


def data_url_modality(text: str) -> Modality | None:
    """The modality of a ``data:`` URL with an image/audio/video MIME type, else ``None``.

    Only the header (``data:<major>/<minor>[;params],``, within its first 256
    characters) is inspected; the payload is never scanned or copied.
    """
    if not text.startswith("data:"):
        return None
    end = text.find(",", 5, 256)
    if end < 0:
        return None
    mime = text[5:end].split(";", 1)[0].strip().lower()
    major, slash, minor = mime.partition("/")
    if not slash or not minor:
        return None
    return _MIME_MAJOR_TO_MODALITY.get(major)


def _url_of(value: object, part_type: str, key: str) -> str:
    """The reference held under ``key``: a string or an object with a ``url``."""
    if isinstance(value, str):
        url = value
    elif isinstance(value, Mapping):
        if key == "input_audio" and "data" in value:
            # chat-completions audio: {"data": <base64>, "format": "wav"}
            data, audio_format = value.get("data"), value.get("format") or "wav"
            if not isinstance(data, str) or not data or not isinstance(audio_format, str):
                raise ProtocolError(f"{part_type}.{key} has no base64 'data' string")
            return inline_audio_url(data, audio_format)
        raw = value.get("url")
        if not isinstance(raw, str):
            raise ProtocolError(f"{part_type}.{key} is an object without a 'url' string")
        url = raw
    else:
        raise ProtocolError(f"{part_type}.{key} must be a string or an object with 'url'")
    if not url.strip():
        raise ProtocolError(f"{part_type}.{key} is empty")
    return url


def media_ref_of_part(part: Mapping[str, object]) -> MediaRef | None:
    """The media reference of one content part, ``None`` for a text or unknown part.

    Raises :class:`ProtocolError` for a media part without a usable reference
    (missing, empty, a ``file_id`` that cannot be resolved).
    """
    part_type = part.get("type")
    if not isinstance(part_type, str):
        return None
    spec = _MEDIA_PART_KEYS.get(part_type)
    if spec is None:
        return None
    modality, keys = spec
    for key in keys:
        value = part.get(key)
        if value is not None:
            return _url_of(value, part_type, key), modality
    if part.get("file_id") is not None:
        raise ProtocolError(
            f"{part_type} references file_id {part.get('file_id')!r}; uploaded files cannot be resolved, "
            "send the media inline (data URL) or as a file:// / http(s) URL"
        )
    raise ProtocolError(f"{part_type} part has none of {', '.join(keys)}")


def media_refs_of_content(content: object) -> Iterator[MediaRef]:
    """Media references in a message's ``content`` (a string or ``None`` is text: nothing)."""
    if not isinstance(content, list):
        return
    for part in content:
        if isinstance(part, Mapping):
            ref = media_ref_of_part(part)
            if ref is not None:
                yield ref


def media_refs_of_tool_output(output: object) -> Iterator[MediaRef]:
    """Media references in a ``function_call_output.output`` (a string or a list of parts)."""
    if isinstance(output, str):
        modality = data_url_modality(output)
        if modality is not None:
            yield output, modality
        return
    yield from media_refs_of_content(output)
