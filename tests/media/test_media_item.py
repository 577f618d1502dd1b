"""MediaItem: laziness, content keys, data URLs, pickling, thread safety, load_media vs decoding."""

from __future__ import annotations

import hashlib
import pickle
import threading
from pathlib import Path

import pytest
from media_assets import bomb_png, corrupt_idat_png, png_bytes
from PIL import ImageFile

from gymbridge.errors import MediaDecodeError, MediaFetchError, MediaPolicyError
from gymbridge.media import MediaItem, MediaPolicy, aload_media, encode_data_url, load_media
from gymbridge.media import local as local_mod


def test_key_is_sha256_of_the_encoded_bytes_whatever_the_reference(png: bytes, tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(png)
    policy = MediaPolicy(allowed_local_roots=(tmp_path,))
    by_url = load_media(encode_data_url(png, "image/png"), "image")
    by_file = load_media(str(tmp_path / "a.png"), "image", policy)
    by_bytes = MediaItem.from_bytes(png, "image")
    assert by_url.key == by_file.key == by_bytes.key == hashlib.sha256(png).hexdigest()
    assert load_media(encode_data_url(png_bytes(seed=1), "image/png"), "image").key != by_url.key


def test_to_data_url_round_trips_and_uses_the_sniffed_mime(png: bytes) -> None:
    item = MediaItem.from_bytes(png, "image", mime="image/jpeg")  # a wrong declared type
    url = item.to_data_url()
    assert url.startswith("data:image/png;base64,")
    assert load_media(url, "image").raw == png


def test_from_ref_reads_nothing_until_asked(
    png: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[str] = []
    real_read = local_mod.read_local

    def counting_read(path: str, policy: MediaPolicy, source: str) -> bytes:
        reads.append(path)
        return real_read(path, policy, source)

    monkeypatch.setattr("gymbridge.media.item.read_local", counting_read)
    (tmp_path / "a.png").write_bytes(png)
    item = MediaItem.from_ref(str(tmp_path / "a.png"), "image", MediaPolicy(allowed_local_roots=(tmp_path,)))
    assert not item.loaded and reads == []
    assert "not loaded" in repr(item)
    assert item.key == hashlib.sha256(png).hexdigest()
    assert item.loaded and len(reads) == 1
    item.image()
    assert item.raw == png
    assert len(reads) == 1  # cached


def test_lazy_item_reports_a_missing_file_on_first_access(tmp_path: Path) -> None:
    item = MediaItem.from_ref(
        str(tmp_path / "gone.png"), "image", MediaPolicy(allowed_local_roots=(tmp_path,))
    )
    with pytest.raises(MediaFetchError, match=r"gone\.png"):
        _ = item.raw


def test_concurrent_first_access_loads_once(
    png: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[int] = []
    real_read = local_mod.read_local
    gate = threading.Barrier(8)

    def slow_read(path: str, policy: MediaPolicy, source: str) -> bytes:
        reads.append(1)
        return real_read(path, policy, source)

    monkeypatch.setattr("gymbridge.media.item.read_local", slow_read)
    (tmp_path / "a.png").write_bytes(png)
    item = MediaItem.from_ref(str(tmp_path / "a.png"), "image", MediaPolicy(allowed_local_roots=(tmp_path,)))
    keys: list[str] = []

    def worker() -> None:
        gate.wait()
        keys.append(item.key)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(reads) == 1 and len(set(keys)) == 1 and len(keys) == 8


def test_pickling_a_lazy_item_sends_the_reference_not_bytes(png: bytes, tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(png)
    policy = MediaPolicy(allowed_local_roots=(tmp_path,))
    lazy = MediaItem.from_ref(str(tmp_path / "a.png"), "image", policy)
    blob = pickle.dumps(lazy)
    assert len(blob) < len(png)
    clone = pickle.loads(blob)
    assert not clone.loaded and clone.source == lazy.source and clone.policy == policy
    assert clone.key == hashlib.sha256(png).hexdigest()


def test_pickling_a_loaded_item_sends_its_bytes_once(png: bytes, tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(png)
    item = load_media(str(tmp_path / "a.png"), "image", MediaPolicy(allowed_local_roots=(tmp_path,)))
    key = item.key
    (tmp_path / "a.png").unlink()  # the clone must not need the file
    clone = pickle.loads(pickle.dumps(item))
    assert clone.loaded and clone.raw == png and clone.key == key and clone.source == item.source
    assert clone.image().size == (24, 16)


def test_pickling_a_loaded_data_url_item_does_not_double_the_payload(png: bytes) -> None:
    big = png_bytes(200, 200)
    item = load_media(encode_data_url(big, "image/png"), "image")
    blob = pickle.dumps(item, protocol=5)
    assert len(blob) < len(big) * 1.1  # bytes only; the base64 text is not pickled too
    clone = pickle.loads(blob)
    assert clone.raw == big and clone.key == item.key
    assert clone.source == encode_data_url(big, "image/png")  # canonical URL, same bytes
    assert load_media(clone.source, "image").key == item.key


def test_protocol_5_sends_the_bytes_out_of_band(png: bytes) -> None:
    item = MediaItem.from_bytes(png, "image", source="s3-like-name.png")
    buffers: list[pickle.PickleBuffer] = []
    blob = pickle.dumps(item, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1 and buffers[0].raw().nbytes == len(png)
    assert len(blob) < 600  # the stream holds the metadata only
    clone = pickle.loads(blob, buffers=buffers)
    assert clone.raw == png and isinstance(clone.raw, bytes) and clone.source == "s3-like-name.png"
    # without a buffer_callback, protocol 5 still round-trips in band; protocol 2 too
    for protocol in (2, 5):
        again = pickle.loads(pickle.dumps(item, protocol=protocol))
        assert again.key == item.key and again.modality == "image"


def test_pickled_lazy_data_url_item_round_trips(png: bytes) -> None:
    url = encode_data_url(png, "image/png")
    clone = pickle.loads(pickle.dumps(MediaItem.from_ref(url, "image")))
    assert not clone.loaded and clone.raw == png


def test_load_media_checks_the_header_but_does_not_decode_pixels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decision: load_media reads the bytes and the header only.

    A decompression bomb declares its size in the header, so it is refused at
    load_media; corrupt pixel data is only found by ``.image()``.
    """
    url = encode_data_url(png_bytes(), "image/png")
    calls: list[int] = []
    real_load = ImageFile.ImageFile.load

    def counting_load(self: ImageFile.ImageFile) -> object:
        calls.append(1)
        return real_load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counting_load)
    item = load_media(url, "image")
    assert calls == []  # no pixel decoded by load_media
    item.image()
    assert calls  # decoded on request

    broken = load_media(encode_data_url(corrupt_idat_png(), "image/png"), "image")  # header fine
    with pytest.raises(MediaDecodeError):
        broken.image()
    with pytest.raises(MediaPolicyError, match="max_pixels"):
        load_media(encode_data_url(bomb_png(20_000, 20_000), "image/png"), "image")


def test_lazy_item_refuses_a_bomb_only_when_decoded() -> None:
    item = MediaItem.from_ref(encode_data_url(bomb_png(20_000, 20_000), "image/png"), "image")
    assert item.nbytes < 200  # bytes are fine; nothing looked at the header yet
    with pytest.raises(MediaPolicyError, match="max_pixels"):
        item.image()


def test_from_bytes_is_size_capped_and_accepts_buffers(png: bytes) -> None:
    assert MediaItem.from_bytes(memoryview(png), "image").raw == png
    with pytest.raises(MediaPolicyError, match="max_encoded_bytes=10"):
        MediaItem.from_bytes(png, "image", policy=MediaPolicy(max_encoded_bytes=10))
    with pytest.raises(TypeError):
        MediaItem.from_bytes("not bytes", "image")  # type: ignore[arg-type]


def test_short_source_hides_big_data_urls(png: bytes) -> None:
    url = encode_data_url(png_bytes(100, 100), "image/png")
    item = MediaItem.from_ref(url, "image")
    assert len(item.short_source) < 90 and item.source == url
    assert len(repr(item)) < 150


async def test_aload_media_matches_load_media(png: bytes, tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(png)
    policy = MediaPolicy(allowed_local_roots=(tmp_path,))
    a = await aload_media(str(tmp_path / "a.png"), "image", policy)
    b = await aload_media(encode_data_url(png, "image/png"), "image")
    assert a.key == b.key == load_media(str(tmp_path / "a.png"), "image", policy).key
    with pytest.raises(MediaPolicyError):
        await aload_media(encode_data_url(bomb_png(20_000, 20_000), "image/png"), "image")
