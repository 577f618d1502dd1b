"""``MediaPolicy``: the limits every media reference is checked against.

A policy is a small immutable value object (pydantic, frozen, unknown keys
refused) so it can be shared across threads, pickled across Ray / process
boundaries, and loaded from YAML. Invariants:

* every numeric limit is strictly positive;
* ``max_decoded_bytes`` bounds the memory a decoder may allocate for audio and
  video (a short, highly compressed file can declare gigabytes of samples);
* ``allowed_local_roots`` is empty by default, so **every** local path is refused
  until a root is named; roots are compared after ``os.path.realpath``;
* ``allowed_http_hosts`` is empty by default; an entry is ``host`` (any port) or
  ``host:port`` (IPv6 as ``[addr]:port`` or a bare address), stored lower-case.
  A listed host skips the private / loopback address check (it is trusted
  explicitly); every other host is resolved and refused when any of its
  addresses is not public;
* ``media_hosts`` (same entry syntax) names the hosts of gymbridge media stores
  (:mod:`gymbridge.media.store`): trusted explicitly like ``allowed_http_hosts``, but
  only for media references (``/media/<content key>``), whose fetched bytes are
  verified against the key, and a redirect off a media host is refused;
* exceeding any limit raises :class:`~gymbridge.errors.MediaPolicyError` naming
  the (shortened) source and the limit.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["MediaPolicy", "parse_host_entry"]

_MiB = 1024 * 1024


def parse_host_entry(entry: str) -> tuple[str, int | None]:
    """Split an ``allowed_http_hosts`` entry into ``(host, port or None)``.

    ``"example.com"`` -> ``("example.com", None)``; ``"example.com:8080"`` ->
    ``("example.com", 8080)``; ``"[::1]:8080"`` -> ``("::1", 8080)``; ``"::1"`` ->
    ``("::1", None)``. Raises ``ValueError`` on a malformed entry.
    """
    text = entry.strip().lower()
    if not text:
        raise ValueError("empty host entry")
    host: str
    port_text: str | None = None
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise ValueError(f"unclosed '[' in host entry {entry!r}")
        host = text[1:close]
        rest = text[close + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"malformed host entry {entry!r}")
            port_text = rest[1:]
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:
        host = text  # a bare name, IPv4 address or IPv6 address
    host = host.rstrip(".")
    if not host or any(c in host for c in "/@?# "):
        raise ValueError(f"malformed host entry {entry!r}")
    if port_text is None:
        return host, None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"bad port in host entry {entry!r}")
    return host, int(port_text)


class MediaPolicy(BaseModel):
    """Limits and trust lists for loading media from untrusted references.

    Defaults suit training data: encoded files up to 64 MiB, images up to
    50 megapixels, clips up to 10 minutes, videos sampled at 2 fps to at most
    64 frames, 30 s to fetch one URL. No local root and no private host is
    trusted by default.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_encoded_bytes: int = Field(default=64 * _MiB, gt=0)
    """Cap on the encoded (file / base64-decoded / downloaded) size, checked before decoding."""
    max_pixels: int = Field(default=50_000_000, gt=0)
    """Cap on ``width * height`` of an image or of one video frame, read from the header."""
    max_frames: int = Field(default=64, gt=0)
    """At most this many frames are returned by ``.video()`` (sampling spreads them evenly)."""
    max_duration_s: float = Field(default=600.0, gt=0)
    """Audio and video longer than this are refused."""
    max_decoded_bytes: int = Field(default=2 * 1024 * _MiB, gt=0)
    """Cap on the decoded size of one audio clip (``frames * channels * 4``) or one video
    (``frames * H * W * 3``), computed from the header before decoding."""
    video_fps: float = Field(default=2.0, gt=0)
    """Frame-rate at which ``.video()`` samples frames (before the ``max_frames`` cap)."""
    allowed_local_roots: tuple[Path, ...] = ()
    """Local files (``file://`` URLs or paths) are read only under these directories."""
    allowed_http_hosts: tuple[str, ...] = ()
    """``host`` or ``host:port`` entries trusted even when they resolve to a private address."""
    media_hosts: tuple[str, ...] = ()
    """``host`` or ``host:port`` of media stores: references there are fetched and verified by key."""
    fetch_timeout_s: float = Field(default=30.0, gt=0)
    """Deadline for one whole fetch: DNS, every redirect hop, and the body."""
    max_redirects: int = Field(default=5, ge=0)
    """Redirect hops followed (each one re-checked) before giving up."""

    @field_validator("allowed_local_roots", mode="after")
    @classmethod
    def _expand_roots(cls, roots: tuple[Path, ...]) -> tuple[Path, ...]:
        return tuple(Path(os.path.expanduser(r)) for r in roots)

    @field_validator("allowed_http_hosts", "media_hosts", mode="after")
    @classmethod
    def _normalise_hosts(cls, hosts: tuple[str, ...]) -> tuple[str, ...]:
        out: list[str] = []
        for entry in hosts:
            host, port = parse_host_entry(entry)
            shown = f"[{host}]" if ":" in host and port is not None else host
            out.append(shown if port is None else f"{shown}:{port}")
        return tuple(out)

    def host_allowed(self, host: str, port: int) -> bool:
        """Whether ``host`` (a name or address, no brackets) on ``port`` is trusted explicitly."""
        return _listed(self.allowed_http_hosts, host, port) or _listed(self.media_hosts, host, port)

    def is_media_host(self, host: str, port: int) -> bool:
        """Whether ``host`` on ``port`` is a media store (``media_hosts``)."""
        return _listed(self.media_hosts, host, port)


def _listed(entries: tuple[str, ...], host: str, port: int) -> bool:
    host = host.lower().rstrip(".")
    for entry in entries:
        entry_host, entry_port = parse_host_entry(entry)
        if entry_host == host and (entry_port is None or entry_port == port):
            return True
    return False
