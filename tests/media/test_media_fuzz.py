"""Fuzz: random and mutated inputs to every entry point may only ever raise ``MediaError``.

Bounded (a few hundred examples per test, no deadline) so the default run stays
fast; DNS is stubbed to fail instantly and fetches time out after 0.3 s so no
example can reach outside the machine or hang.
"""

from __future__ import annotations

import base64
import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from media_assets import audio_bytes, av_audio_bytes, jpeg_bytes, mp4_bytes, png_bytes, video_bytes

from gymbridge.errors import MediaError
from gymbridge.media import MediaItem, MediaPolicy, encode_data_url, load_media, shorten

# mutated JPEGs make Pillow warn about corrupt EXIF; expected, not a finding
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

MODALITIES = st.sampled_from(["image", "audio", "video"])
FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
SMALL = MediaPolicy(
    max_encoded_bytes=1 << 20,
    max_pixels=1 << 20,
    max_frames=8,
    max_duration_s=30.0,
    max_decoded_bytes=64 << 20,
    fetch_timeout_s=0.3,
)
SEEDS = [
    png_bytes(),
    jpeg_bytes(orientation=6),
    audio_bytes("WAV"),
    audio_bytes("FLAC"),
    mp4_bytes(num_frames=6),
    video_bytes("matroska", "mpeg4", num_frames=6),
    av_audio_bytes("mp4", "aac", seconds=0.3),
]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    r = tmp_path_factory.mktemp("fuzzroot")
    for i, seed in enumerate(SEEDS):
        (r / f"f{i}.bin").write_bytes(seed)
    return r


@pytest.fixture
def no_dns() -> Iterator[None]:
    def fail(host: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(host, str):
            host.encode("idna")  # like the real resolver: bad names fail with UnicodeError first
        raise socket.gaierror(socket.EAI_NONAME, "fuzz: no DNS")

    with mock.patch.object(socket, "getaddrinfo", fail):
        yield


def decode_all(item: MediaItem) -> None:
    if item.modality == "image":
        item.image()
    elif item.modality == "audio":
        item.audio()
    else:
        item.video()


def assert_names_source(exc: MediaError, source: str) -> None:
    """Every refusal carries the shortened source and shows it in its message."""
    assert exc.source == shorten(source), (exc.source, str(exc))
    assert repr(exc.source) in str(exc), str(exc)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A real asset, truncated and/or with a few bytes overwritten."""
    raw = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(0, 4))):
        pos = draw(st.integers(0, len(raw) - 1))
        chunk = draw(st.binary(min_size=1, max_size=8))
        raw[pos : pos + len(chunk)] = chunk
    if draw(st.booleans()):
        raw = raw[: draw(st.integers(0, len(raw)))]
    return bytes(raw)


@FUZZ
@given(raw=st.one_of(st.binary(max_size=512), mutated()), modality=MODALITIES)
def test_decoders_only_raise_media_errors(raw: bytes, modality: Any) -> None:
    try:
        item = MediaItem.from_bytes(raw, modality, policy=SMALL)
        item.probe()
        decode_all(item)
    except MediaError:
        pass


@FUZZ
@given(raw=st.one_of(st.binary(max_size=512), mutated()), modality=MODALITIES)
def test_load_media_of_data_urls_only_raises_media_errors(raw: bytes, modality: Any) -> None:
    url = encode_data_url(raw, "application/octet-stream")
    try:
        decode_all(load_media(url, modality, SMALL))
    except MediaError as exc:
        assert_names_source(exc, url)


PREFIXES = st.sampled_from(
    [
        "",
        "data:",
        "data:image/png;base64,",
        "data:;base64,",
        "file://",
        "file:///",
        "http://",
        "https://",
        "http://[",
        "http://a..",
        "http://xn--",
        "ftp://",
        "javascript:",
        "/",
        "../",
        "~/",
    ]
)


@FUZZ
@given(prefix=PREFIXES, text=st.text(max_size=80), modality=MODALITIES)
def test_load_media_of_random_strings_only_raises_media_errors(
    prefix: str, text: str, modality: Any, root: Path, no_dns: None
) -> None:
    policy = SMALL.model_copy(update={"allowed_local_roots": (root,)})
    for source in (
        prefix + text,
        f"{root}/{text}",
        "data:;base64," + base64.b64encode(text.encode()).decode(),
    ):
        for attempt in (load_media, MediaItem.from_ref):
            try:
                decode_all(attempt(source, modality, policy))
            except MediaError as exc:
                assert_names_source(exc, source)


@pytest.mark.slow
@settings(max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=mutated(), modality=MODALITIES)
def test_deep_fuzz_of_mutated_assets(raw: bytes, modality: Any) -> None:
    """Opt-in (``-m slow``): 25x more mutated assets through probe and decode."""
    with contextlib.suppress(MediaError):
        item = MediaItem.from_bytes(raw, modality, policy=SMALL)
        item.probe()
        decode_all(item)
