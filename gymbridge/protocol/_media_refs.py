"""Where a media reference sits in NeMo Gym's JSON: one answer for the raw dicts and the models.

Pure functions over the raw JSON shapes (dicts and lists as parsed from the wire);
they return ``(source, modality)`` pairs in order of appearance and never touch the
bytes behind a reference (no fetching, no decoding, no base64 work). The part models
of :mod:`gymbridge.protocol._content` answer ``.source`` with the same rules
(:func:`inline_audio_url`, :data:`VIDEO_KEYS`), so a walk over raw dicts (the
trajectory postprocessor, the chat renderer) and code over parsed models agree on
every part.

Invariants:

* parts of these types carry media: ``input_image`` / ``input_audio`` /
  ``input_video`` (Responses API, plus gymbridge's audio part), their
  chat-completions spellings ``image_url`` / ``audio_url`` / ``video_url`` (agents
  built on chat models inject them verbatim) and the bare ``image`` / ``audio`` /
  ``video`` spellings (``{"type": "image", "image": url}``, as Hugging Face chat
  templates and some agents write them); text parts carry none;
* a part of any other type that still carries media (a media key such as ``image_url``,
  or a ``data:`` URL of an image/audio/video MIME type in any string value) raises
  :class:`~gymbridge.errors.ProtocolError` naming the type and the key: read as media or
  refused, never dropped; other unknown parts carry none;
* ``metadata.audio_data`` (a data URI, or a list of them), ``metadata.audio_path`` (one
  absolute file path) and ``metadata.audio_paths`` (a list of them) are NeMo Gym's audio
  side channel (genuine ``vllm_model``), mutually exclusive; :func:`metadata_audio_refs`
  returns them as audio references, in order. A path is read later under the media policy's
  allowed local roots (refused there otherwise); a relative path is refused here, since
  gymbridge has no audio root to resolve it against;
* a plain string ``content`` is text; a ``function_call_output.output`` string is media only as
  a ``data:`` URL of an ``image/*``, ``audio/*`` or ``video/*`` MIME type; a part that claims to be
  media but has no usable reference raises :class:`~gymbridge.errors.ProtocolError`;
* :func:`inline_media_sources` / :func:`replace_media_sources` (media by reference) see
  the parts of message ``content`` and of ``function_call_output.output`` lists whose
  reference is a ``data:`` URL in a URL slot (a string, or an object's ``url``); a bare
  data-URL string as a tool output and inline ``{data, format}`` audio have no such slot
  and are left alone, and ``replace_media_sources`` never mutates: changed parts are new
  dicts in new lists, everything else is the same object.
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
    "inline_media_sources",
    "media_ref_of_part",
    "media_refs_of_content",
    "media_refs_of_tool_output",
    "metadata_audio_refs",
    "replace_media_sources",
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
    "image": ("image", ("image", "image_url", "url")),
    "audio": ("audio", ("audio", "audio_url", "url")),
    "video": ("video", ("video", "video_url", "url")),
}
#: Keys that hold media in some part spelling: an unknown part type carrying one is refused.
_MEDIA_KEYS: frozenset[str] = frozenset(
    key for _, keys in _MEDIA_PART_KEYS.values() for key in keys if key != "url"
)
#: Part types known to carry no media (their string values are text, never references).
_TEXT_PART_TYPES: frozenset[str] = frozenset(
    {"input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text"}
)


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
        _refuse_hidden_media(part, part_type)
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


def _refuse_hidden_media(part: Mapping[str, object], part_type: str) -> None:
    """An unknown part type that carries media is an error, so its media are never dropped."""
    if part_type in _TEXT_PART_TYPES:
        return
    for key, value in part.items():
        if key in _MEDIA_KEYS and value is not None:
            raise ProtocolError(
                f"content part type {part_type!r} is not a known media part but carries media under "
                f"{key!r}; use input_image / input_audio / input_video"
            )
        if isinstance(value, str) and data_url_modality(value) is not None:
            raise ProtocolError(
                f"content part type {part_type!r} is not a known media part but its {key!r} holds a "
                f"{data_url_modality(value)} data URL; use input_image / input_audio / input_video"
            )


def metadata_audio_refs(metadata: Mapping[str, object]) -> list[MediaRef]:
    """Audio references of ``responses_create_params.metadata``, in order (see the module invariants).

    Raises :class:`ProtocolError` for more than one of the three keys, a value of the wrong
    shape, an empty entry or a relative path.
    """
    present = [key for key in ("audio_data", "audio_path", "audio_paths") if metadata.get(key)]
    if len(present) > 1:
        raise ProtocolError(
            f"metadata audio keys are mutually exclusive, got {present}: set one of audio_data, "
            "audio_path, audio_paths"
        )
    if not present:
        return []
    key = present[0]
    value = metadata[key]
    if key == "audio_path":
        values: list[object] = [value]
    elif isinstance(value, list):
        values = list(value)
    elif key == "audio_data":
        values = [value]
    else:
        raise ProtocolError(f"metadata.audio_paths must be a list of paths, got {type(value).__name__}")
    refs: list[MediaRef] = []
    for position, entry in enumerate(values):
        where = f"metadata.{key}" + (f"[{position}]" if key != "audio_path" else "")
        if not isinstance(entry, str) or not entry.strip():
            raise ProtocolError(f"{where} must be a non-empty string, got {entry!r}")
        if key != "audio_data" and not entry.startswith(("/", "file://")):
            raise ProtocolError(
                f"{where} = {entry!r} is a relative path: give an absolute path under one of the media "
                "policy's allowed local roots (gymbridge has no audio_root to resolve it against)"
            )
        refs.append((entry, "audio"))
    return refs


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


def _inline_slot(part: object) -> tuple[str, str] | None:
    """``(part key, data URL)`` of a media part whose reference is an inline data URL in a URL slot."""
    if not isinstance(part, Mapping):
        return None
    try:
        ref = media_ref_of_part(part)
    except ProtocolError:
        return None  # the reader of the part answers it with its own precise error
    if ref is None or ref[0][:5].lower() != "data:":
        return None
    source = ref[0]
    for key, value in part.items():
        if value is source or (isinstance(value, Mapping) and value.get("url") is source):
            return str(key), source
    return None  # inline audio {data, format}: no URL slot to put a reference in


def _part_lists(item: object) -> tuple[Mapping[str, object], str, list[object]] | None:
    """``(item, field, parts)`` of an item whose parts may carry media (message content, tool output list)."""
    if not isinstance(item, Mapping):
        return None
    kind = item.get("type", "message")
    field = "content" if kind == "message" else "output" if kind == "function_call_output" else None
    parts = item.get(field) if field is not None else None
    return (item, field, parts) if field is not None and isinstance(parts, list) else None


def inline_media_sources(items: object) -> Iterator[str]:
    """The inline (``data:``) media references of conversation ``items`` that a reference may replace."""
    if not isinstance(items, list):
        return
    for item in items:
        found = _part_lists(item)
        if found is None:
            continue
        for part in found[2]:
            slot = _inline_slot(part)
            if slot is not None:
                yield slot[1]


def replace_media_sources(items: list[object], new: Mapping[str, str]) -> list[object]:
    """``items`` with every inline reference found in ``new`` replaced by ``new[source]`` (see the
    module invariants); the same list when nothing changed."""
    out: list[object] = []
    for item in items:
        found = _part_lists(item)
        if found is None:
            out.append(item)
            continue
        mapping, field, parts = found
        new_parts: list[object] = []
        for part in parts:
            slot = _inline_slot(part)
            if slot is None or slot[1] not in new or not isinstance(part, Mapping):
                new_parts.append(part)
                continue
            key, source = slot
            value = part[key]
            ref = new[source]
            slot_value = ref if isinstance(value, str) else {**value, "url": ref}
            new_parts.append({**part, key: slot_value})
        changed = any(a is not b for a, b in zip(new_parts, parts, strict=True))
        out.append({**mapping, field: new_parts} if changed else item)
    return items if all(a is b for a, b in zip(out, items, strict=True)) else out
