"""Data URLs are parsed by their header only; the payload is validated when the bytes load.

``MediaItem.from_ref`` sits on the trajectory walk's hot path (one call per image
per turn), so a data URL must cost O(header) there: no NUL scan, no payload copy,
no base64 work. Every refusal of a malformed payload still happens — with the same
error type and message — when ``.raw`` / ``.key`` / ``load_media`` read the bytes.
"""

from __future__ import annotations

import base64
import pickle
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from media_assets import png_bytes

from gymbridge.errors import MediaDecodeError, MediaPolicyError
from gymbridge.media import MediaItem, MediaPolicy, encode_data_url, load_media, shorten
from gymbridge.media.refs import MAX_DATA_HEADER_CHARS, DataRef, decode_data_payload, parse_ref

BIG = MediaPolicy(max_encoded_bytes=64 << 20)


def test_from_ref_on_a_20mb_data_url_is_o_header_not_o_payload() -> None:
    """No payload copy and no base64 decode: ``from_ref`` allocates a few KiB, whatever the payload
    (a NUL scan is ruled out by the malformed-payload test below). Its speed against a bare
    ``b64decode``: benchmarks/bench_media.py."""
    raw = bytes(range(256)) * (15 * (1 << 20) // 256)  # 15 MiB -> a 20 MiB data URL
    url = encode_data_url(raw, "image/png")
    assert len(url) > 20_000_000

    MediaItem.from_ref(encode_data_url(png_bytes(), "image/png"), "image", BIG)  # lazy imports, caches
    tracemalloc.start()
    try:
        item = MediaItem.from_ref(url, "image", BIG)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"from_ref allocated {peak / 2**20:.1f} MiB for a 20 MiB data URL"
    assert not item.loaded
    assert item.raw == raw  # and the bytes are right once loaded


def test_data_ref_points_into_the_url_instead_of_copying_the_payload() -> None:
    url = encode_data_url(png_bytes(), "image/png")
    ref = parse_ref(url)
    assert isinstance(ref, DataRef)
    assert ref.url is url
    assert url[ref.payload_offset - 1] == "," and ref.payload_len == len(url) - len("data:image/png;base64,")
    assert ref.payload == url[len("data:image/png;base64,") :]
    assert url[-20:] not in repr(ref)  # the repr never carries the payload


@pytest.mark.parametrize(
    ("url", "error", "message"),
    [
        ("data:image/png;base64,AAAA\x00AAAA", MediaPolicyError, "contains a NUL character"),
        ("data:image/png;base64,AAAAÄ\x00AAA", MediaPolicyError, "contains a NUL character"),
        ("data:text/plain,hello\x00world", MediaPolicyError, "contains a NUL character"),
        ("data:image/png;base64,!!!notbase64!!!", MediaDecodeError, "base64 does not decode"),
        ("data:image/png;base64,AAAA=AAA", MediaDecodeError, "base64 does not decode"),
        ("data:image/png;base64,A", MediaDecodeError, "base64 does not decode"),
        ("data:image/png;base64,ÄÖÜ", MediaDecodeError, "base64 payload is not ASCII"),
        ("data:image/png;base64,", MediaDecodeError, "has an empty payload"),
    ],
)
def test_malformed_payloads_pass_from_ref_and_are_refused_when_the_bytes_load(
    url: str, error: type[Exception], message: str
) -> None:
    item = MediaItem.from_ref(url, "image")  # header only: accepted, nothing read
    assert not item.loaded
    for load in (lambda: item.raw, lambda: item.key, lambda: load_media(url, "image")):
        with pytest.raises(error, match=message) as info:
            load()
        assert repr(shorten(url)) in str(info.value)
        assert info.value.source == shorten(url)  # type: ignore[attr-defined]
    assert not item.loaded  # a failed load caches nothing


@pytest.mark.parametrize(
    ("url", "error", "message"),
    [
        ("data:image/\x00png;base64,AAAA", MediaPolicyError, "contains a NUL character"),
        ("data:image/png;base64" + "A" * 5000, MediaDecodeError, "no ',' before the payload"),
        (
            "data:" + "x" * (MAX_DATA_HEADER_CHARS + 1) + ",AAAA",
            MediaDecodeError,
            "no ',' before the payload",
        ),
    ],
)
def test_malformed_headers_are_still_refused_at_parse_time(
    url: str, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        MediaItem.from_ref(url, "image")


def test_oversize_estimate_uses_the_payload_length_at_parse_time() -> None:
    policy = MediaPolicy(max_encoded_bytes=3000)
    ok = "data:image/png;base64," + "A" * 4000  # ~3000 bytes: within the 5 % slack
    over = "data:image/png;base64," + "A" * 4400  # ~3300 bytes
    MediaItem.from_ref(ok, "image", policy)
    with pytest.raises(MediaPolicyError, match="decodes to about 3300 bytes"):
        MediaItem.from_ref(over, "image", policy)


def test_lazy_data_item_pickles_and_loads_after_the_round_trip() -> None:
    raw = png_bytes()
    item = MediaItem.from_ref(encode_data_url(raw, "image/png"), "image")
    clone = pickle.loads(pickle.dumps(item))
    assert not clone.loaded and clone.raw == raw and clone.key == item.key


@settings(max_examples=100, deadline=None)
@given(raw=st.binary(min_size=1, max_size=300), cut=st.integers(min_value=0), wrap=st.booleans())
def test_property_header_parse_then_decode_equals_the_bytes_and_nul_anywhere_is_refused(
    raw: bytes, cut: int, wrap: bool
) -> None:
    b64 = base64.b64encode(raw).decode()
    if wrap:
        b64 = "\n".join(b64[i : i + 76] for i in range(0, len(b64), 76))
    url = "data:application/octet-stream;base64," + b64
    ref = parse_ref(url)
    assert isinstance(ref, DataRef) and ref.is_base64
    assert decode_data_payload(ref, max_bytes=1 << 20, source=url) == raw

    at = ref.payload_offset + cut % (ref.payload_len + 1)
    poisoned = url[:at] + "\x00" + url[at:]
    item = MediaItem.from_ref(poisoned, "image")  # lazy: accepted
    with pytest.raises(MediaPolicyError, match="contains a NUL character"):
        _ = item.raw
