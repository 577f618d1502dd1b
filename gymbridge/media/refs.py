"""Media references: parsing, shortening for messages, MIME sniffing, data URLs.

A reference is one of

* a ``data:`` URL (``data:[<mime>][;param…][;base64],<payload>``);
* a ``file://`` URL (empty host or ``localhost``) or a plain filesystem path;
* an ``http://`` / ``https://`` URL.

Anything else (``ftp:``, ``javascript:``, ``gopher:`` …) is refused with
:class:`~gymbridge.errors.MediaPolicyError`. Parsing is pure: no filesystem,
network or decoding work happens here.

Parsing a data URL costs O(header), not O(payload): only ``data:<mime>;…,`` (at
most :data:`MAX_DATA_HEADER_CHARS` characters) is read; the payload is neither
scanned nor copied — :class:`DataRef` keeps the URL and the payload's offset, the
size cap is checked from the payload's length, and the payload is validated (NUL
characters, the base64 alphabet, padding) only when its bytes are decoded by
:func:`decode_data_payload`, with the same error types and messages as a parse-time
refusal.

Every error message names the source shortened by :func:`shorten` (a data URL: its
first 60 characters plus the total length; a long path or URL: its head and tail,
so the file name shows), so a multi-megabyte data URL never floods a log.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass, field
from urllib.parse import unquote, unquote_to_bytes, urlsplit

from gymbridge.errors import MediaDecodeError, MediaPolicyError

__all__ = [
    "MAX_DATA_HEADER_CHARS",
    "DataRef",
    "FileRef",
    "HttpRef",
    "MediaRef",
    "check_data_size",
    "decode_data_payload",
    "encode_data_url",
    "parse_ref",
    "shorten",
    "sniff_mime",
]

SHORT_LEN = 60
#: The longest ``data:<mime>;<params>,`` header accepted (a longer one is refused as malformed);
#: bounds the work :func:`parse_ref` does on a data URL whatever its size.
MAX_DATA_HEADER_CHARS = 1024
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):")


def shorten(source: str, limit: int = SHORT_LEN) -> str:
    """``source`` for messages: a data URL cut to its first ``limit`` characters plus its length;
    a path or URL kept whole up to ``2 * limit`` characters, else its head and its tail (the
    file name is what a reader needs)."""
    if source[:5].lower() == "data:":
        if len(source) <= limit:
            return source
        return f"{source[:limit]}…({len(source)} chars)"
    if len(source) <= 2 * limit:
        return source
    half = limit - 10
    return f"{source[:half]}…{source[-half:]}"


@dataclass(frozen=True, slots=True)
class DataRef:
    """A ``data:`` URL parsed by its header: ``url[payload_offset:]`` is the payload (after the first comma).

    The payload is not copied out of ``url`` (a screenshot's data URL is megabytes);
    :attr:`payload_len` is free, :attr:`payload` slices on each access.
    """

    mime: str | None
    is_base64: bool
    url: str = field(repr=False)
    payload_offset: int

    @property
    def payload_len(self) -> int:
        """Characters in the payload (no copy)."""
        return len(self.url) - self.payload_offset

    @property
    def payload(self) -> str:
        """The text after the first comma (a copy: call it when decoding, not when parsing)."""
        return self.url[self.payload_offset :]


@dataclass(frozen=True, slots=True)
class FileRef:
    """A local file: the path exactly as referenced (percent-decoded for ``file://``)."""

    path: str


@dataclass(frozen=True, slots=True)
class HttpRef:
    """An ``http(s)`` URL; ``host`` is lower-case without brackets, ``port`` explicit or default."""

    url: str
    scheme: str
    host: str
    port: int


MediaRef = DataRef | FileRef | HttpRef


def parse_ref(source: str) -> MediaRef:
    """Classify ``source``; raise ``MediaPolicyError`` for a refused scheme or malformed URL."""
    if not isinstance(source, str):
        raise TypeError(f"a media reference must be a str, got {type(source).__name__}")
    short = shorten(source)
    if not source:
        raise MediaPolicyError("empty media reference ''", source=short)
    if source[:5].lower() == "data:":
        # header only: a NUL in the payload is refused by decode_data_payload when the bytes load
        return _parse_data(source, short)
    if "\x00" in source:
        raise _nul_error(short)
    match = _SCHEME.match(source)
    if match is None or len(match.group(1)) == 1:  # no scheme, or a Windows drive letter
        return FileRef(path=source)
    scheme = match.group(1).lower()
    if scheme == "file":
        return _parse_file(source, short)
    if scheme in ("http", "https"):
        return parse_http(source, short)
    raise MediaPolicyError(
        f"media reference {short!r}: scheme {scheme!r} is not allowed (allowed: data, file, http, https)",
        source=short,
    )


def _nul_error(short: str) -> MediaPolicyError:
    return MediaPolicyError(f"media reference {short!r} contains a NUL character", source=short)


def _parse_data(source: str, short: str) -> DataRef:
    """Parse ``data:<mime>;<params>,`` — O(header): the payload is neither scanned nor copied."""
    comma = source.find(",", 5, 5 + MAX_DATA_HEADER_CHARS)
    if comma < 0:
        if len(source) <= 5 + MAX_DATA_HEADER_CHARS:
            reason = "no ',' before the payload"
        else:
            reason = f"no ',' before the payload within its first {MAX_DATA_HEADER_CHARS} characters"
        if "\x00" in source[: 5 + MAX_DATA_HEADER_CHARS]:
            raise _nul_error(short)
        raise MediaDecodeError(f"malformed data URL {short!r}: {reason}", source=short)
    header = source[5:comma]
    if "\x00" in header:
        raise _nul_error(short)
    params = [p.strip() for p in header.split(";")]
    is_base64 = bool(params) and params[-1].lower() == "base64"
    mime = params[0].lower() if params and "/" in params[0] else None
    return DataRef(mime=mime, is_base64=is_base64, url=source, payload_offset=comma + 1)


def _parse_file(source: str, short: str) -> FileRef:
    try:
        parts = urlsplit(source)
    except ValueError as exc:  # e.g. "file://[": an unclosed IPv6 host
        raise MediaPolicyError(f"malformed file URL {short!r}: {exc}", source=short) from exc
    if parts.netloc not in ("", "localhost"):
        raise MediaPolicyError(
            f"file URL {short!r} names a remote host {parts.netloc!r}; only local files are allowed",
            source=short,
        )
    if parts.query or parts.fragment:
        raise MediaPolicyError(
            f"file URL {short!r} has a query or fragment; percent-encode '?' and '#' in paths",
            source=short,
        )
    path = unquote(parts.path)
    if not path.startswith("/"):
        raise MediaPolicyError(f"file URL {short!r} must hold an absolute path", source=short)
    if "\x00" in path:
        raise MediaPolicyError(f"file URL {short!r} contains a NUL character", source=short)
    return FileRef(path=path)


def parse_http(url: str, short: str | None = None) -> HttpRef:
    """Parse and sanity-check an ``http(s)`` URL (also used for every redirect hop)."""
    short = shorten(url) if short is None else short
    try:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        host = parts.hostname
        port = parts.port
    except ValueError as exc:
        raise MediaPolicyError(f"malformed URL {short!r}: {exc}", source=short) from exc
    if scheme not in ("http", "https"):
        raise MediaPolicyError(
            f"URL {short!r}: scheme {scheme!r} is not allowed (allowed: http, https)", source=short
        )
    if not host:
        raise MediaPolicyError(f"URL {short!r} has no host", source=short)
    if parts.username is not None or parts.password is not None:
        raise MediaPolicyError(f"URL {short!r} carries credentials (user@host); refused", source=short)
    if any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in url):
        raise MediaPolicyError(f"URL {short!r} contains whitespace or control characters", source=short)
    if port is None:
        port = 443 if scheme == "https" else 80
    host = host.rstrip(".")
    if not host.isascii():
        try:  # internationalised names resolve (and are allow-listed) in their ASCII form
            host = host.encode("idna").decode("ascii")
        except UnicodeError as exc:
            raise MediaPolicyError(f"URL {short!r} has an invalid host name: {exc}", source=short) from exc
    return HttpRef(url=url, scheme=scheme, host=host.lower(), port=port)


def check_data_size(ref: DataRef, *, max_bytes: int, source: str) -> None:
    """Refuse a data URL whose payload surely decodes to more than ``max_bytes``, without decoding it.

    Base64: ``3/4`` of the payload length, with 5 % slack for MIME line wrapping
    (the exact size is checked after decoding). Percent-encoding: at least one byte
    per three characters.
    """
    n = ref.payload_len
    estimate = n * 3 // 4 if ref.is_base64 else n // 3
    if estimate > max_bytes * 1.05 + 3:
        short = shorten(source)
        raise MediaPolicyError(
            f"data URL {short!r} decodes to about {estimate} bytes, over max_encoded_bytes={max_bytes}",
            source=short,
        )


def decode_data_payload(ref: DataRef, *, max_bytes: int, source: str) -> bytes:
    """The bytes of a data URL, refusing oversize payloads *before* decoding them.

    This is where the payload is first read: a NUL character anywhere in it raises
    ``MediaPolicyError`` (as :func:`parse_ref` does for other references). Base64 is
    decoded strictly (standard or URL-safe alphabet, ASCII whitespace ignored,
    missing ``=`` padding tolerated); anything else raises ``MediaDecodeError``.
    Non-base64 payloads are percent-decoded.
    """
    short = shorten(source)
    check_data_size(ref, max_bytes=max_bytes, source=source)
    payload = ref.payload
    if not ref.is_base64:
        if "\x00" in payload:
            raise _nul_error(short)
        raw = unquote_to_bytes(payload)
    else:
        try:
            text = payload.encode("ascii")
        except UnicodeEncodeError as exc:
            if "\x00" in payload:
                raise _nul_error(short) from None
            raise MediaDecodeError(f"data URL {short!r}: base64 payload is not ASCII", source=short) from exc
        del payload  # the ASCII bytes are all that is needed; free the str copy early
        if b"\x00" in text:
            raise _nul_error(short)
        if b"\n" in text or b"\r" in text or b" " in text or b"\t" in text:
            text = text.translate(None, delete=b"\t\n\r ")
        if b"-" in text or b"_" in text:
            text = text.replace(b"-", b"+").replace(b"_", b"/")
        if len(text) % 4:
            text += b"=" * (-len(text) % 4)
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise MediaDecodeError(
                f"data URL {short!r}: base64 does not decode ({exc})", source=short
            ) from exc
    if len(raw) > max_bytes:
        raise MediaPolicyError(
            f"data URL {short!r} holds {len(raw)} bytes, over max_encoded_bytes={max_bytes}", source=short
        )
    if not raw:
        raise MediaDecodeError(f"data URL {short!r} has an empty payload", source=short)
    return raw


def encode_data_url(raw: bytes, mime: str) -> str:
    """``data:<mime>;base64,<payload>`` for ``raw`` (standard alphabet, padded)."""
    return f"data:{mime};base64,{base64.b64encode(raw).decode('ascii')}"


def sniff_mime(raw: bytes) -> str | None:
    """The MIME type the magic bytes at the start of ``raw`` announce, or ``None``."""
    head = raw[:64]
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if head.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "image/gif"
    if head.startswith(b"BM"):
        return "image/bmp"
    if head.startswith((b"II*\x00", b"MM\x00*")):
        return "image/tiff"
    if head.startswith(b"RIFF") and len(head) >= 12:
        kind = head[8:12]
        return {b"WEBP": "image/webp", b"WAVE": "audio/wav", b"AVI ": "video/x-msvideo"}.get(kind)
    if head.startswith(b"RF64"):
        return "audio/wav"
    if head.startswith(b"fLaC"):
        return "audio/flac"
    if head.startswith(b"OggS"):
        return "audio/ogg"
    if head.startswith(b"FORM") and head[8:12] in (b"AIFF", b"AIFC"):
        return "audio/aiff"
    if head.startswith(b"ID3") or (
        len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0 and head[1] & 0x06
    ):
        return "audio/mpeg"
    if head[4:8] == b"ftyp":
        brand = head[8:12]
        if brand == b"qt  ":
            return "video/quicktime"
        if brand.startswith(b"M4A"):
            return "audio/mp4"
        return "video/mp4"
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return "video/webm" if b"webm" in raw[:64] else "video/x-matroska"
    return None
