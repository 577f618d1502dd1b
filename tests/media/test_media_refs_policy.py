"""Reference parsing, data URLs, MIME sniffing and the MediaPolicy value object."""

from __future__ import annotations

import base64
import pickle
from pathlib import Path

import pytest
from media_assets import audio_bytes, jpeg_bytes, mp4_bytes, png_bytes
from pydantic import ValidationError

import gymbridge.media as media
from gymbridge.errors import MediaDecodeError, MediaError, MediaPolicyError
from gymbridge.media import MediaPolicy, encode_data_url, load_media, shorten, sniff_mime
from gymbridge.media.refs import DataRef, FileRef, HttpRef, decode_data_payload, parse_ref


def test_public_api_is_sorted_and_importable() -> None:
    assert media.__all__ == sorted(media.__all__)
    for name in media.__all__:
        assert hasattr(media, name), name


@pytest.mark.parametrize(
    ("source", "kind"),
    [
        ("data:image/png;base64,AAAA", DataRef),
        ("file:///tmp/a.png", FileRef),
        ("file://localhost/tmp/a.png", FileRef),
        ("/tmp/a.png", FileRef),
        ("relative/a.png", FileRef),
        ("C:/images/a.png", FileRef),
        ("http://example.com/a.png", HttpRef),
        ("HTTPS://Example.COM:8443/a.png", HttpRef),
    ],
)
def test_parse_ref_classifies_references(source: str, kind: type) -> None:
    assert isinstance(parse_ref(source), kind)


def test_http_ref_normalises_host_and_default_port() -> None:
    ref = parse_ref("HTTPS://Example.COM./a.png")
    assert isinstance(ref, HttpRef)
    assert (ref.host, ref.port, ref.scheme) == ("example.com", 443, "https")


@pytest.mark.parametrize(
    "source",
    [
        "ftp://example.com/a.png",
        "javascript:alert(1)",
        "gopher://example.com/",
        "blob:https://example.com/uuid",
        "file://otherhost/etc/passwd",
        "http://user:pw@example.com/a.png",
        "http:///nohost",
        "http://example.com:99999/a.png",
        "",
        "/tmp/a\x00.png",
    ],
)
def test_refused_references_raise_policy_error_naming_the_source(source: str) -> None:
    with pytest.raises(MediaPolicyError) as info:
        load_media(source, "image")
    assert repr(shorten(source)) in str(info.value)
    assert info.value.source == shorten(source)


@pytest.mark.parametrize("source", ["file://[", "file://[::1/x.png", "http://[", "https://[::1"])
def test_regression_unclosed_ipv6_bracket_is_a_policy_error_not_value_error(source: str) -> None:
    """Found by the fuzz test: ``urlsplit`` raised a bare ValueError for ``file://[``."""
    with pytest.raises(MediaPolicyError, match="malformed"):
        load_media(source, "image")


@pytest.mark.parametrize(
    "url", ["http://a..b/x.png", "http://" + "a" * 70 + ".com/x.png", "http://x\x7f.com/"]
)
def test_regression_bad_host_names_are_media_errors_not_unicode_errors(url: str) -> None:
    """Hosts the IDNA codec rejects used to escape the resolver as a bare UnicodeError."""
    with pytest.raises(MediaError):
        load_media(url, "image")


def test_international_host_names_are_normalised_to_ascii() -> None:
    ref = parse_ref("https://Bücher.example/a.png")
    assert isinstance(ref, HttpRef) and ref.host == "xn--bcher-kva.example"


def test_other_scheme_message_names_the_allowed_schemes() -> None:
    with pytest.raises(MediaPolicyError, match=r"scheme 'ftp' is not allowed.*http, https"):
        load_media("ftp://example.com/a.png", "image")


def test_shorten_keeps_short_sources_and_cuts_long_ones_to_60_chars() -> None:
    assert shorten("short") == "short"
    long = "data:image/png;base64," + "A" * 10_000
    out = shorten(long)
    assert out.startswith(long[:60]) and "10022 chars" in out and len(out) < 90


def test_data_url_round_trip_and_params() -> None:
    raw = png_bytes()
    url = encode_data_url(raw, "image/png")
    ref = parse_ref(url)
    assert isinstance(ref, DataRef) and ref.mime == "image/png" and ref.is_base64
    assert decode_data_payload(ref, max_bytes=10**6, source=url) == raw
    with_params = "data:image/png;name=a.png;base64," + base64.b64encode(raw).decode()
    assert load_media(with_params, "image").raw == raw


def test_data_url_tolerates_wrapping_missing_padding_and_urlsafe_alphabet() -> None:
    raw = bytes(range(256)) * 3
    b64 = base64.b64encode(raw).decode()
    wrapped = "\n".join(b64[i : i + 76] for i in range(0, len(b64), 76))
    ref = parse_ref("data:application/octet-stream;base64," + wrapped)
    assert isinstance(ref, DataRef)
    assert decode_data_payload(ref, max_bytes=10**6, source="x") == raw
    urlsafe = base64.urlsafe_b64encode(raw[:31]).decode().rstrip("=")
    ref2 = parse_ref("data:;base64," + urlsafe)
    assert isinstance(ref2, DataRef)
    assert decode_data_payload(ref2, max_bytes=10**6, source="x") == raw[:31]


def test_percent_encoded_data_url() -> None:
    ref = parse_ref("data:text/plain,hello%20world")
    assert isinstance(ref, DataRef) and not ref.is_base64
    assert decode_data_payload(ref, max_bytes=100, source="x") == b"hello world"


@pytest.mark.parametrize(
    "url",
    [
        "data:image/png;base64,!!!notbase64!!!",
        "data:image/png;base64,A",  # one char can never be base64
        "data:image/png;base64,AAAA=AAA",  # padding in the middle
        "data:image/png;base64,ÄÖÜ",
        "data:image/png;base64,",
        "data:image/png;base64",  # no comma at all
    ],
)
def test_bad_base64_is_a_decode_error(url: str) -> None:
    with pytest.raises(MediaDecodeError) as info:
        load_media(url, "image")
    assert url[:15] in str(info.value)


def test_oversize_data_url_is_refused_before_base64_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_decoding(*args: object, **kwargs: object) -> bytes:
        raise AssertionError("base64 was decoded before the size check")

    monkeypatch.setattr(base64, "b64decode", no_decoding)
    policy = MediaPolicy(max_encoded_bytes=1000)
    url = "data:image/png;base64," + "A" * 4000
    with pytest.raises(MediaPolicyError, match=r"max_encoded_bytes=1000") as info:
        load_media(url, "image", policy)
    assert "data:image/png;base64,AAAA" in str(info.value)
    # the lazy constructor refuses it too, without decoding
    with pytest.raises(MediaPolicyError, match="max_encoded_bytes=1000"):
        media.MediaItem.from_ref(url, "image", policy)


def test_exact_cap_is_enforced_on_decoded_length() -> None:
    raw = b"\x01" * 1001
    url = encode_data_url(raw, "application/octet-stream")
    with pytest.raises(MediaPolicyError, match="1001 bytes"):
        _ = media.MediaItem.from_ref(url, "image", MediaPolicy(max_encoded_bytes=1000)).raw


@pytest.mark.parametrize(
    ("raw", "mime"),
    [
        (png_bytes(), "image/png"),
        (jpeg_bytes(), "image/jpeg"),
        (audio_bytes("WAV"), "audio/wav"),
        (audio_bytes("FLAC"), "audio/flac"),
        (mp4_bytes(num_frames=2), "video/mp4"),
        (b"GIF89a....", "image/gif"),
        (b"RIFF\x00\x00\x00\x00WEBPVP8 ", "image/webp"),
        (b"\x1a\x45\xdf\xa3\x00webm", "video/webm"),
        (b"hello", None),
    ],
)
def test_sniff_mime_from_magic_bytes(raw: bytes, mime: str | None) -> None:
    assert sniff_mime(raw) == mime


# ----------------------------------------------------------------------------- policy


def test_policy_defaults_suit_training_data_and_trust_nothing() -> None:
    p = MediaPolicy()
    assert p.max_encoded_bytes >= 32 * 2**20
    assert p.max_pixels >= 20_000_000
    assert p.allowed_local_roots == () and p.allowed_http_hosts == ()
    assert p.fetch_timeout_s > 0 and p.max_frames > 0 and p.max_duration_s > 0


def test_policy_is_frozen_strict_and_validated() -> None:
    p = MediaPolicy()
    with pytest.raises(ValidationError):
        p.max_pixels = 1  # type: ignore[misc]
    with pytest.raises(ValidationError):
        MediaPolicy(max_pixel=5)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        MediaPolicy(max_encoded_bytes=0)
    with pytest.raises(ValidationError):
        MediaPolicy(allowed_http_hosts=("bad host:80",))
    with pytest.raises(ValidationError):
        MediaPolicy(allowed_http_hosts=("example.com:0",))


def test_policy_host_entries_match_host_or_host_port() -> None:
    p = MediaPolicy(allowed_http_hosts=("Images.Example.com", "127.0.0.1:8080", "[::1]:9000"))
    assert p.allowed_http_hosts == ("images.example.com", "127.0.0.1:8080", "[::1]:9000")
    assert p.host_allowed("images.example.com", 443) and p.host_allowed("IMAGES.example.com.", 8443)
    assert p.host_allowed("127.0.0.1", 8080) and not p.host_allowed("127.0.0.1", 8081)
    assert p.host_allowed("::1", 9000) and not p.host_allowed("::1", 80)
    assert not p.host_allowed("evil.example.com", 443)


def test_policy_pickles_and_round_trips_json(tmp_path: Path) -> None:
    p = MediaPolicy(allowed_local_roots=(tmp_path,), allowed_http_hosts=("a.b:1",), max_frames=3)
    assert pickle.loads(pickle.dumps(p)) == p
    assert MediaPolicy.model_validate_json(p.model_dump_json()) == p


def test_every_refusal_is_a_media_error() -> None:
    for source in ("ftp://x", "data:,", "/etc/passwd"):
        with pytest.raises(MediaError):
            load_media(source, "image")
