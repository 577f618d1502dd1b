"""Decoders: round trips for PNG, JPEG (EXIF), WAV, FLAC, MP4, and every decode-time refusal."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
import soundfile as sf
from media_assets import (
    audio_bytes,
    av_audio_bytes,
    bomb_png,
    corrupt_idat_png,
    jpeg_bytes,
    mp4_bytes,
    png_bytes,
    tone,
    video_bytes,
)
from PIL import Image

from gymbridge.errors import MediaDecodeError, MediaPolicyError
from gymbridge.media import MediaItem, MediaPolicy, encode_data_url, load_media

# ----------------------------------------------------------------------------- images


def test_png_round_trip_is_pixel_exact(png: bytes) -> None:
    item = load_media(encode_data_url(png, "image/png"), "image")
    img = item.image()
    assert img.mode == "RGB" and img.size == (24, 16)
    expected = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    assert np.array_equal(np.asarray(img), expected)
    assert item.mime == "image/png" and item.nbytes == len(png)


def test_jpeg_exif_orientation_is_applied() -> None:
    plain = MediaItem.from_bytes(jpeg_bytes(orientation=None), "image").image()
    assert plain.size == (32, 16)
    # orientation 6: the camera was rotated; the displayed image is 90° clockwise
    rotated = MediaItem.from_bytes(jpeg_bytes(orientation=6), "image").image()
    assert rotated.size == (16, 32)
    arr = np.asarray(rotated).astype(int)
    # after a 90° clockwise turn the left (red) half is on top
    assert arr[2, 8, 0] > 200 and arr[2, 8, 2] < 60
    assert arr[-3, 8, 2] > 200 and arr[-3, 8, 0] < 60


def test_rgba_is_composited_onto_white() -> None:
    arr = np.zeros((4, 4, 4), dtype=np.uint8)  # fully transparent black
    buf = io.BytesIO()
    Image.fromarray(arr, mode="RGBA").save(buf, format="PNG")
    img = MediaItem.from_bytes(buf.getvalue(), "image").image()
    assert img.mode == "RGB"
    assert np.all(np.asarray(img) == 255)


def test_grayscale_and_palette_become_rgb() -> None:
    for mode in ("L", "P", "CMYK"):
        buf = io.BytesIO()
        Image.new(mode, (3, 2)).save(buf, format="JPEG" if mode == "CMYK" else "PNG")
        img = MediaItem.from_bytes(buf.getvalue(), "image").image()
        assert img.mode == "RGB" and img.size == (3, 2)


def test_decompression_bomb_png_is_refused_at_load_from_its_header() -> None:
    bomb = bomb_png(100_000, 100_000)  # 10 gigapixels declared in ~100 bytes
    assert len(bomb) < 200
    with pytest.raises(MediaPolicyError, match=r"max_pixels|decompression bomb") as info:
        load_media(encode_data_url(bomb, "image/png"), "image")
    assert "data:image/png;base64," in str(info.value)


def test_bomb_under_pillows_limit_but_over_the_policy_is_refused() -> None:
    bomb = bomb_png(9000, 9000)  # 81 MP: Pillow would only warn
    with pytest.raises(MediaPolicyError, match=r"9000x9000 = 81000000 pixels, over max_pixels=50000000"):
        MediaItem.from_bytes(bomb, "image").image()
    with pytest.raises(MediaPolicyError, match="max_pixels=100"):
        MediaItem.from_bytes(png_bytes(), "image", policy=MediaPolicy(max_pixels=100)).image()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_images_are_decode_errors(fmt: str) -> None:
    raw = png_bytes(64, 64) if fmt == "PNG" else jpeg_bytes(64, 64)
    for cut in (len(raw) // 2, len(raw) - 20, 40):
        item = MediaItem.from_bytes(raw[:cut], "image", source=f"cut.{fmt}")
        with pytest.raises(MediaDecodeError, match=r"cut\.") as info:
            item.image()
        assert "truncated or corrupt" in str(info.value) or "not a supported image" in str(info.value)


def test_corrupt_png_data_is_a_decode_error() -> None:
    with pytest.raises(MediaDecodeError, match="truncated or corrupt"):
        MediaItem.from_bytes(corrupt_idat_png(), "image").image()
    raw = bytearray(png_bytes(64, 64))
    raw[100:140] = b"\xff" * 40  # breaks the CRC / zlib stream
    with pytest.raises(MediaDecodeError):
        MediaItem.from_bytes(bytes(raw), "image").image()


def test_corrupt_jpeg_is_a_decode_error() -> None:
    raw = jpeg_bytes(64, 64)
    dht = raw.find(b"\xff\xc4")
    broken_tables = raw[: dht + 4] + b"\xff" * 26 + raw[dht + 30 :]
    with pytest.raises(MediaDecodeError, match="truncated or corrupt"):
        MediaItem.from_bytes(broken_tables, "image").image()
    sof = raw.find(b"\xff\xc0")
    no_frame_header = raw[: sof + 1] + b"\x01" + raw[sof + 2 :]
    with pytest.raises(MediaDecodeError):
        load_media(encode_data_url(no_frame_header, "image/jpeg"), "image")


def test_unsupported_or_dangerous_image_formats_are_refused() -> None:
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
    with pytest.raises(MediaDecodeError, match="not a supported image"):
        MediaItem.from_bytes(eps, "image").image()
    with pytest.raises(MediaDecodeError, match="not a supported image"):
        load_media(encode_data_url(audio_bytes(), "audio/wav"), "image")


# ----------------------------------------------------------------------------- audio


@pytest.mark.parametrize("fmt", ["WAV", "FLAC"])
def test_audio_round_trip(fmt: str) -> None:
    item = load_media(encode_data_url(audio_bytes(fmt), "audio/x"), "audio")
    wave, rate = item.audio()
    assert rate == 16000 and wave.dtype == np.float32 and wave.shape == (4000,)
    np.testing.assert_allclose(wave, tone(), atol=1e-3)  # PCM_16 quantisation
    assert item.mime == ("audio/wav" if fmt == "WAV" else "audio/flac")


@pytest.mark.parametrize(
    ("fmt", "subtype"), [("MP3", "MPEG_LAYER_III"), ("OGG", "VORBIS"), ("AIFF", "PCM_16")]
)
def test_lossy_and_other_libsndfile_formats(fmt: str, subtype: str) -> None:
    buf = io.BytesIO()
    sf.write(buf, tone(seconds=1.0), 16000, format=fmt, subtype=subtype)
    wave, rate = load_media(encode_data_url(buf.getvalue(), "audio/x"), "audio").audio()
    assert rate == 16000 and wave.dtype == np.float32 and wave.shape == (16000,)
    spectrum = np.abs(np.fft.rfft(wave[:8000]))
    assert abs(np.argmax(spectrum) * 2 - 440) <= 4  # the tone survives the codec


def test_stereo_audio_keeps_channels_last() -> None:
    wave, rate = MediaItem.from_bytes(audio_bytes("FLAC", channels=2, rate=8000), "audio").audio()
    assert wave.shape == (2000, 2) and rate == 8000


def test_truncated_wav_is_refused_although_libsndfile_would_pad(wav: bytes) -> None:
    with sf.SoundFile(io.BytesIO(wav[: len(wav) // 2])) as f:  # the library silently shortens it
        assert f.frames < 4000
    with pytest.raises(MediaDecodeError, match="truncated: WAV data chunk declares"):
        MediaItem.from_bytes(wav[: len(wav) // 2], "audio").audio()
    with pytest.raises(MediaDecodeError, match="truncated"):
        load_media(encode_data_url(wav[:30], "audio/wav"), "audio")


def test_corrupt_wav_header_is_a_decode_error(wav: bytes) -> None:
    fmt = wav.find(b"fmt ")
    zero_channels = wav[: fmt + 10] + b"\x00\x00" + wav[fmt + 12 :]
    with pytest.raises(MediaDecodeError, match="truncated or corrupt"):
        MediaItem.from_bytes(zero_channels, "audio").audio()
    with pytest.raises(MediaDecodeError):
        load_media(encode_data_url(b"RIFF\x10\x00\x00\x00WAVEjunkjunkjunk", "audio/wav"), "audio")


def test_truncated_and_corrupt_flac_are_decode_errors(flac: bytes) -> None:
    with pytest.raises(MediaDecodeError):
        MediaItem.from_bytes(flac[: len(flac) // 2], "audio").audio()
    with pytest.raises(MediaDecodeError):
        MediaItem.from_bytes(b"fLaC" + b"\x00" * 100, "audio").audio()


def test_audio_longer_than_the_policy_is_refused_from_the_header() -> None:
    raw = audio_bytes("WAV", seconds=2.0, rate=8000)
    with pytest.raises(MediaPolicyError, match=r"lasts 2\.0 s, over max_duration_s=1\.0"):
        load_media(encode_data_url(raw, "audio/wav"), "audio", MediaPolicy(max_duration_s=1.0))


def test_audio_decoded_size_cap() -> None:
    raw = audio_bytes("WAV", seconds=1.0, rate=8000)
    with pytest.raises(MediaPolicyError, match="max_decoded_bytes=1000"):
        MediaItem.from_bytes(raw, "audio", policy=MediaPolicy(max_decoded_bytes=1000)).audio()


@pytest.mark.parametrize(("fmt", "codec", "rate"), [("mp4", "aac", 16000), ("webm", "libopus", 48000)])
def test_m4a_and_webm_audio_decode_through_pyav(fmt: str, codec: str, rate: int) -> None:
    if codec not in av.codecs_available:
        pytest.skip(f"this FFmpeg build has no {codec} encoder")
    raw = av_audio_bytes(fmt, codec, seconds=1.0, rate=rate)
    item = load_media(encode_data_url(raw, "audio/x"), "audio")
    wave, got_rate = item.audio()
    assert got_rate == rate and wave.dtype == np.float32 and wave.ndim == 1
    assert abs(wave.shape[0] - rate) <= rate // 20  # one second, give or take codec padding
    # a lossy codec keeps the tone: its dominant frequency is still 440 Hz
    spectrum = np.abs(np.fft.rfft(wave[: rate // 2]))
    assert abs(np.argmax(spectrum) * 2 - 440) <= 4
    with pytest.raises(MediaPolicyError, match=r"max_duration_s=0\.5"):
        load_media(encode_data_url(raw, "audio/x"), "audio", MediaPolicy(max_duration_s=0.5))
    with pytest.raises(MediaDecodeError):
        MediaItem.from_bytes(raw[: len(raw) // 2], "audio").audio()


def test_image_bytes_are_not_audio(png: bytes) -> None:
    with pytest.raises(MediaDecodeError):
        MediaItem.from_bytes(png, "audio").audio()


# ----------------------------------------------------------------------------- video


def test_mp4_round_trip_with_fps_sampling(mp4: bytes) -> None:
    item = load_media(encode_data_url(mp4, "video/mp4"), "video")
    clip = item.video_clip(fps=2.0)
    frames = clip.frames
    assert frames.dtype == np.uint8 and frames.shape == (4, 32, 32, 3)
    np.testing.assert_allclose(clip.timestamps_s, [0.0, 0.5, 1.0, 1.5], atol=1e-6)
    # frame i is grey level 10*i: sampled frames 0, 5, 10, 15
    np.testing.assert_allclose(frames.mean(axis=(1, 2, 3)), [0, 50, 100, 150], atol=4)
    assert item.video(fps=100.0).shape[0] == 20  # every frame when fps >= the source rate
    assert item.mime == "video/mp4"


def test_frame_cap_spreads_frames_over_the_whole_clip(mp4: bytes) -> None:
    item = MediaItem.from_bytes(mp4, "video", policy=MediaPolicy(max_frames=3))
    clip = item.video_clip(fps=10.0)
    assert clip.frames.shape[0] == 3
    assert clip.timestamps_s[-1] >= 1.3  # not just the first 0.3 s
    assert item.video(max_frames=2).shape[0] == 2


def test_video_over_duration_or_pixels_is_refused_before_decoding(mp4: bytes) -> None:
    with pytest.raises(MediaPolicyError, match=r"lasts 2\.0 s, over max_duration_s=1\.5"):
        load_media(encode_data_url(mp4, "video/mp4"), "video", MediaPolicy(max_duration_s=1.5))
    with pytest.raises(MediaPolicyError, match=r"32x32 = 1024 pixels, over max_pixels=1000"):
        MediaItem.from_bytes(mp4, "video", policy=MediaPolicy(max_pixels=1000)).video()
    with pytest.raises(MediaPolicyError, match="max_decoded_bytes=5000"):
        MediaItem.from_bytes(mp4, "video", policy=MediaPolicy(max_decoded_bytes=5000)).video()


def test_truncated_mp4_is_a_decode_error(mp4: bytes) -> None:
    for cut in (len(mp4) // 2, len(mp4) - 100, len(mp4) - 1, 12):
        with pytest.raises(MediaDecodeError, match=r"truncated|corrupt|not a supported container"):
            MediaItem.from_bytes(mp4[:cut], "video").video()


@pytest.mark.parametrize(
    ("fmt", "codec"), [("matroska", "libx264"), ("webm", "libvpx-vp9"), ("avi", "mpeg4")]
)
def test_other_containers_round_trip_and_refuse_truncation(fmt: str, codec: str) -> None:
    if codec not in av.codecs_available:
        pytest.skip(f"this FFmpeg build has no {codec} encoder")
    raw = video_bytes(fmt, codec)
    clip = MediaItem.from_bytes(raw, "video").video_clip(fps=2.0)
    assert clip.frames.shape == (4, 32, 32, 3)
    np.testing.assert_allclose(clip.timestamps_s, [0.0, 0.5, 1.0, 1.5], atol=1e-6)
    for cut in (len(raw) // 2, len(raw) - 1):
        # FFmpeg would decode the prefix without complaint; the container size gives it away
        with pytest.raises(
            MediaDecodeError, match=f"truncated: the {'AVI' if fmt == 'avi' else 'Matroska/WebM'} container"
        ):
            load_media(encode_data_url(raw[:cut], "video/x"), "video")


def test_corrupt_mp4_is_a_decode_error(mp4: bytes) -> None:
    raw = bytearray(mp4)
    raw[40:400] = b"\x00" * 360
    with pytest.raises(MediaDecodeError):
        MediaItem.from_bytes(bytes(raw), "video").video()


def test_non_video_containers_are_refused_before_ffmpeg_probes_them(png: bytes) -> None:
    playlist = b"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\nfile:///etc/passwd\n#EXT-X-ENDLIST\n"
    for raw in (playlist, png, b"ffconcat version 1.0\nfile /etc/passwd\n"):
        with pytest.raises(MediaDecodeError, match="not a supported container"):
            MediaItem.from_bytes(raw, "video").video()


def test_decoder_for_the_wrong_modality_is_a_programming_error(png: bytes) -> None:
    with pytest.raises(TypeError, match="is image, not audio"):
        MediaItem.from_bytes(png, "image").audio()
    with pytest.raises(ValueError, match="unknown modality"):
        MediaItem.from_bytes(png, "text")  # type: ignore[arg-type]


def test_fresh_mp4_fixture_is_well_formed() -> None:
    assert MediaItem.from_bytes(mp4_bytes(num_frames=3, fps=3), "video").video().shape[0] == 2
