"""Decoders for encoded media bytes: Pillow (images), soundfile (audio), PyAV (video).

Each modality has a cheap ``probe_*`` that reads only the header (format,
dimensions, duration) and enforces the :class:`MediaPolicy` limits, and a
``decode_*`` that probes first and only then decodes. Invariants:

* limits are checked from the header **before** any pixel / sample is decoded:
  ``max_pixels`` (images and each video frame — decompression bombs),
  ``max_duration_s`` (audio, video); exceeding one raises ``MediaPolicyError``;
* only known-safe container formats are opened: images in
  :data:`IMAGE_FORMATS` (no EPS / Ghostscript and friends), video in ISO-BMFF
  (mp4 / mov), Matroska / WebM and AVI, selected from the magic bytes so
  FFmpeg never probes a playlist or other format that could open further
  files or URLs;
* truncated or corrupt data raises ``MediaDecodeError`` — including the
  cases the libraries let through: a PNG cut after its pixel data (``verify``),
  a WAV whose ``data`` chunk is cut short, an AVI / Matroska / WebM file shorter
  than its container declares, an MP4 that yields fewer frames than its header
  declares;
* no third-party exception escapes: each is mapped to ``MediaDecodeError``
  with the (shortened) source in the message.

Outputs: ``decode_image`` -> RGB ``PIL.Image`` with EXIF orientation applied
(transparent pixels composited onto white); ``decode_audio`` -> ``(float32
[N] mono or [N, C], sample_rate)`` (soundfile; the audio track of MP4 / M4A
and Matroska / WebM files through PyAV); ``decode_video`` -> :class:`VideoClip`,
uint8 frames ``[T, H, W, 3]`` sampled at ``fps`` and capped at ``max_frames``
(spread evenly over the clip when the cap binds) plus their timestamps ``[T]``.
"""

from __future__ import annotations

import io
import logging
import math
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from PIL import Image, ImageOps, UnidentifiedImageError

from gymbridge.errors import MediaDecodeError, MediaError, MediaPolicyError
from gymbridge.media.policy import MediaPolicy

__all__ = [
    "IMAGE_FORMATS",
    "AudioHeader",
    "ImageHeader",
    "VideoClip",
    "VideoHeader",
    "decode_audio",
    "decode_image",
    "decode_video",
    "probe",
    "probe_audio",
    "probe_image",
    "probe_video",
]

logger = logging.getLogger(__name__)

IMAGE_FORMATS: tuple[str, ...] = ("PNG", "JPEG", "MPO", "GIF", "WEBP", "BMP", "TIFF")
"""Pillow formats ``.image()`` opens; everything else is refused."""

_MAX_SAMPLE_RATE = 1_000_000  # Hz; a header claiming more is hostile or corrupt


@contextmanager
def _mapped(kind: str, source: str) -> Iterator[None]:
    """Map any third-party failure inside the block to ``MediaDecodeError``."""
    # Pillow's warnings about damaged metadata (corrupt EXIF, ...) are left alone on purpose:
    # ``warnings.catch_warnings`` swaps process-global state and is unsafe in decoder threads.
    try:
        yield
    except MediaError:
        raise
    except Image.DecompressionBombError as exc:
        raise MediaPolicyError(f"image {source!r} is a decompression bomb: {exc}", source=source) from exc
    except MemoryError as exc:
        raise MediaDecodeError(f"{kind} {source!r}: out of memory while decoding", source=source) from exc
    except Exception as exc:  # third-party decoders raise a zoo of types; map them in one place
        raise MediaDecodeError(
            f"{kind} {source!r} is truncated or corrupt: {type(exc).__name__}: {exc}", source=source
        ) from exc


# ----------------------------------------------------------------------------- images


@dataclass(frozen=True, slots=True)
class ImageHeader:
    format: str
    width: int
    height: int


def _open_image(raw: bytes, policy: MediaPolicy, source: str) -> tuple[Image.Image, ImageHeader]:
    Image.init()  # registers every plugin once; ``formats=`` fails on names not yet registered
    try:
        img = Image.open(io.BytesIO(raw), formats=[f for f in IMAGE_FORMATS if f in Image.OPEN])
    except Image.DecompressionBombError as exc:
        raise MediaPolicyError(
            f"image {source!r} is a decompression bomb, over max_pixels={policy.max_pixels}: {exc}",
            source=source,
        ) from exc
    except UnidentifiedImageError as exc:
        raise MediaDecodeError(
            f"image {source!r} is not a supported image ({', '.join(IMAGE_FORMATS)})", source=source
        ) from exc
    header = ImageHeader(format=str(img.format), width=img.width, height=img.height)
    if header.width <= 0 or header.height <= 0:
        raise MediaDecodeError(f"image {source!r} declares an empty size {img.size}", source=source)
    if header.width * header.height > policy.max_pixels:
        raise MediaPolicyError(
            f"image {source!r} declares {header.width}x{header.height} = {header.width * header.height} "
            f"pixels, over max_pixels={policy.max_pixels} (decompression bomb guard)",
            source=source,
        )
    return img, header


def probe_image(raw: bytes, policy: MediaPolicy, source: str) -> ImageHeader:
    """Format and size from the header only; refuses over ``max_pixels``."""
    with _mapped("image", source):
        img, header = _open_image(raw, policy, source)
        img.close()
        return header


def decode_image(raw: bytes, policy: MediaPolicy, source: str) -> Image.Image:
    """Decode to an RGB image (first frame), EXIF orientation applied."""
    with _mapped("image", source):
        img, header = _open_image(raw, policy, source)
        if header.format == "PNG":
            # Pillow decodes a PNG cut after its pixel data without complaint; verify() walks
            # every chunk (CRCs, IEND) so a truncated file is refused
            img.verify()
            img, _ = _open_image(raw, policy, source)
        img.load()
        transposed = ImageOps.exif_transpose(img)
        if transposed is not None:
            img = transposed
        if img.mode == "RGB":
            return img
        has_alpha = img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (
            img.mode == "P" and "transparency" in img.info
        )
        if has_alpha:
            rgba = img.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        return img.convert("RGB")


# ----------------------------------------------------------------------------- audio


@dataclass(frozen=True, slots=True)
class AudioHeader:
    format: str
    sample_rate: int
    channels: int
    num_frames: int | None
    """Samples per channel; ``None`` when the container does not say (decode enforces the caps)."""
    duration_s: float | None


def _check_riff_wave(raw: bytes, source: str) -> None:
    """Refuse a RIFF/WAVE whose ``data`` chunk is shorter than it declares (libsndfile pads silently)."""
    if not (raw.startswith(b"RIFF") and raw[8:12] == b"WAVE"):
        return
    pos = 12
    while pos + 8 <= len(raw):
        chunk_id = raw[pos : pos + 4]
        (size,) = struct.unpack_from("<I", raw, pos + 4)
        if chunk_id == b"data":
            available = len(raw) - pos - 8
            if size > available and size != 0xFFFFFFFF:  # 0xFFFFFFFF: streamed, size unknown
                raise MediaDecodeError(
                    f"audio {source!r} is truncated: WAV data chunk declares {size} bytes, "
                    f"{available} present",
                    source=source,
                )
            return
        pos += 8 + size + (size & 1)
    raise MediaDecodeError(f"audio {source!r} is truncated or corrupt: WAV has no data chunk", source=source)


def _open_audio(raw: bytes, source: str) -> Any:
    import soundfile

    _check_riff_wave(raw, source)
    return soundfile.SoundFile(io.BytesIO(raw))


def _audio_header(f: Any, policy: MediaPolicy, source: str) -> AudioHeader:
    rate = int(f.samplerate)
    if not 0 < rate <= _MAX_SAMPLE_RATE:
        raise MediaDecodeError(f"audio {source!r} declares an invalid sample rate {rate}", source=source)
    frames = int(f.frames)
    duration = frames / rate
    if duration > policy.max_duration_s:
        raise MediaPolicyError(
            f"audio {source!r} lasts {duration:.1f} s, over max_duration_s={policy.max_duration_s}",
            source=source,
        )
    if frames <= 0:
        raise MediaDecodeError(f"audio {source!r} holds no samples", source=source)
    decoded_bytes = frames * max(1, int(f.channels)) * 4
    if decoded_bytes > policy.max_decoded_bytes:
        raise MediaPolicyError(
            f"audio {source!r} would decode to {decoded_bytes} bytes "
            f"({frames} frames x {f.channels} channels), "
            f"over max_decoded_bytes={policy.max_decoded_bytes}",
            source=source,
        )
    return AudioHeader(
        format=str(f.format),
        sample_rate=rate,
        channels=int(f.channels),
        num_frames=frames,
        duration_s=duration,
    )


def _av_audio_container(raw: bytes) -> str | None:
    """The FFmpeg demuxer for audio that libsndfile cannot read (m4a / mp4, mkv / webm), or None."""
    if raw[4:8] == b"ftyp":
        return "mov"
    if raw.startswith(b"\x1a\x45\xdf\xa3"):
        return "matroska"
    return None


def _declared_duration(
    container: Any, stream: Any, policy: MediaPolicy, source: str, kind: str
) -> float | None:
    """The stream's (else the container's) declared duration in seconds, ``None`` when unknown;
    refuses one over ``max_duration_s`` (``MediaPolicyError``) or negative / not finite (corrupt)."""
    duration: float | None = None
    if stream.duration is not None and stream.time_base is not None:
        duration = float(stream.duration * stream.time_base)
    elif container.duration is not None:
        duration = container.duration / 1_000_000
    if duration is None:
        return None
    if not math.isfinite(duration) or duration < 0:
        raise MediaDecodeError(f"{kind} {source!r} declares an invalid duration {duration}", source=source)
    if duration > policy.max_duration_s:
        raise MediaPolicyError(
            f"{kind} {source!r} lasts {duration:.1f} s, over max_duration_s={policy.max_duration_s}",
            source=source,
        )
    return duration


def _av_audio_header(container: Any, fmt: str, policy: MediaPolicy, source: str) -> AudioHeader:
    if not container.streams.audio:
        raise MediaDecodeError(f"audio {source!r} has no audio stream", source=source)
    stream = container.streams.audio[0]
    rate = int(stream.codec_context.sample_rate or 0)
    channels = int(stream.codec_context.layout.nb_channels or 0)
    if not 0 < rate <= _MAX_SAMPLE_RATE or channels <= 0:
        raise MediaDecodeError(
            f"audio {source!r} declares an invalid format ({rate} Hz, {channels} channels)", source=source
        )
    duration = _declared_duration(container, stream, policy, source, "audio")
    frames = None if duration is None else round(duration * rate)
    # unknown duration: budget for the longest clip the policy allows; decoding enforces it
    budget = round(policy.max_duration_s * rate) if frames is None else frames
    if budget * channels * 4 > policy.max_decoded_bytes:
        raise MediaPolicyError(
            f"audio {source!r} may decode to {budget * channels * 4} bytes, "
            f"over max_decoded_bytes={policy.max_decoded_bytes}",
            source=source,
        )
    return AudioHeader(
        format=fmt, sample_rate=rate, channels=channels, num_frames=frames, duration_s=duration
    )


def _decode_audio_av(
    raw: bytes, fmt: str, policy: MediaPolicy, source: str
) -> tuple[npt.NDArray[np.float32], int]:
    import av

    _check_declared_size(raw, fmt, source, "audio")
    with av.open(io.BytesIO(raw), mode="r", format=fmt) as container:
        header = _av_audio_header(container, fmt, policy, source)
        stream = container.streams.audio[0]
        resampler = av.AudioResampler(
            format="fltp", layout=stream.codec_context.layout, rate=header.sample_rate
        )
        known = header.num_frames is not None
        declared = header.num_frames if header.num_frames is not None else 0
        # codec padding is a few ms; decoding 1 s past the declared length (or past the cap) is hostile
        limit = (
            declared if known else round(policy.max_duration_s * header.sample_rate)
        ) + header.sample_rate
        chunks: list[npt.NDArray[np.float32]] = []
        total = 0

        def take(frames: list[Any]) -> int:
            for out in frames:
                chunks.append(out.to_ndarray())
            return sum(int(out.samples) for out in frames)

        for frame in container.decode(stream):
            total += take(resampler.resample(frame))
            if total > limit:
                raise MediaPolicyError(
                    f"audio {source!r} decodes past its declared duration / max_duration_s="
                    f"{policy.max_duration_s}",
                    source=source,
                )
        total += take(resampler.resample(None))
    if total == 0:
        raise MediaDecodeError(f"audio {source!r} is truncated or corrupt: no sample decodes", source=source)
    wave = np.concatenate(chunks, axis=1)
    if known:
        wave = wave[:, :declared]  # drop encoder padding
        if wave.shape[1] < declared - header.sample_rate // 10:
            raise MediaDecodeError(
                f"audio {source!r} is truncated: decoded {wave.shape[1]} of {declared} samples",
                source=source,
            )
    out: npt.NDArray[np.float32] = np.ascontiguousarray(wave[0] if wave.shape[0] == 1 else wave.T)
    return out, header.sample_rate


def probe_audio(raw: bytes, policy: MediaPolicy, source: str) -> AudioHeader:
    """Format, rate, channels and duration from the header; refuses over ``max_duration_s``."""
    fmt = _av_audio_container(raw)
    if fmt is not None:
        import av

        with _mapped("audio", source):
            _check_declared_size(raw, fmt, source, "audio")
            with av.open(io.BytesIO(raw), mode="r", format=fmt) as container:
                return _av_audio_header(container, fmt, policy, source)
    with _mapped("audio", source), _open_audio(raw, source) as f:
        return _audio_header(f, policy, source)


def decode_audio(raw: bytes, policy: MediaPolicy, source: str) -> tuple[npt.NDArray[np.float32], int]:
    """Decode to ``(float32 waveform, sample_rate)``: ``[N]`` for mono, ``[N, C]`` otherwise.

    libsndfile reads WAV, FLAC, OGG / Opus, MP3, AIFF, …; the audio track of an
    MP4 / M4A or Matroska / WebM file is decoded with PyAV instead.
    """
    fmt = _av_audio_container(raw)
    if fmt is not None:
        with _mapped("audio", source):
            return _decode_audio_av(raw, fmt, policy, source)
    with _mapped("audio", source), _open_audio(raw, source) as f:
        header = _audio_header(f, policy, source)
        frames = int(f.frames)
        wave: npt.NDArray[np.float32] = f.read(frames=frames, dtype="float32", always_2d=False)
        if wave.shape[0] != frames:
            raise MediaDecodeError(
                f"audio {source!r} is truncated: read {wave.shape[0]} of {frames} frames",
                source=source,
            )
        return wave, header.sample_rate


# ----------------------------------------------------------------------------- video


def _video_container(raw: bytes, source: str) -> str:
    if raw[4:8] == b"ftyp" or raw[4:8] in (b"moov", b"mdat", b"wide", b"free"):
        return "mov"
    if raw.startswith(b"\x1a\x45\xdf\xa3"):
        return "matroska"
    if raw.startswith(b"RIFF") and raw[8:12] == b"AVI ":
        return "avi"
    raise MediaDecodeError(
        f"video {source!r} is not a supported container (mp4/mov, mkv/webm, avi)", source=source
    )


_CONTAINER_NAMES = {"mov": "MP4/MOV", "matroska": "Matroska/WebM", "avi": "AVI"}


def _ebml_vint(raw: bytes, pos: int, source: str) -> tuple[int, int, bool]:
    """Read an EBML variable-size integer at ``pos``: ``(value, next_pos, is_unknown_size)``."""
    if pos >= len(raw) or raw[pos] == 0:
        raise MediaDecodeError(
            f"video {source!r} is truncated or corrupt: bad Matroska header", source=source
        )
    length = 9 - raw[pos].bit_length()
    if pos + length > len(raw):
        raise MediaDecodeError(f"video {source!r} is truncated: Matroska header cut short", source=source)
    value = raw[pos] & ((1 << (8 - length)) - 1)
    for i in range(1, length):
        value = (value << 8) | raw[pos + i]
    return value, pos + length, value == (1 << (7 * length)) - 1


def _check_declared_size(raw: bytes, container: str, source: str, kind: str = "video") -> None:
    """Refuse a file shorter than its container declares (FFmpeg decodes such a prefix silently).

    MP4 / MOV: every top-level box must end inside the file; AVI: the RIFF size;
    Matroska / WebM: the Segment size (unless "unknown", as in live streams).
    """
    declared: int | None = None
    if container == "mov":
        pos = 0
        while pos + 8 <= len(raw):  # walk the top-level boxes; the last must end inside the file
            size = struct.unpack_from(">I", raw, pos)[0]
            if size == 1 and pos + 16 <= len(raw):
                size = struct.unpack_from(">Q", raw, pos + 8)[0]
            elif size == 0:  # "to the end of the file"
                break
            if size < 8:
                raise MediaDecodeError(
                    f"{kind} {source!r} is corrupt: bad MP4 box size {size}", source=source
                )
            pos += size
        else:
            if pos < len(raw):  # 1-7 bytes left: a box header cut short
                declared = pos + 8
            elif pos > len(raw):
                declared = pos
    elif container == "avi" and len(raw) >= 8:
        declared = 8 + struct.unpack_from("<I", raw, 4)[0]
    elif container == "matroska":
        _, pos, _ = _ebml_vint(raw, 0, source)  # the EBML header's ID is read like a size
        size, pos, unknown = _ebml_vint(raw, pos, source)
        pos += size
        if raw[pos : pos + 4] == b"\x18\x53\x80\x67":  # Segment
            size, body, unknown = _ebml_vint(raw, pos + 4, source)
            if not unknown:
                declared = body + size
    if declared is not None and declared > len(raw):
        name = _CONTAINER_NAMES.get(container, container)
        raise MediaDecodeError(
            f"{kind} {source!r} is truncated: the {name} container declares {declared} bytes, "
            f"{len(raw)} present",
            source=source,
        )


@dataclass(frozen=True, slots=True)
class VideoHeader:
    container: str
    codec: str
    width: int
    height: int
    duration_s: float | None
    num_frames: int | None
    average_fps: float | None


@dataclass(frozen=True, slots=True)
class VideoClip:
    frames: npt.NDArray[np.uint8]
    """``[T, H, W, 3]`` RGB frames."""
    timestamps_s: npt.NDArray[np.float64]
    """``[T]`` presentation time of each frame in seconds."""


def _video_header(container: Any, fmt: str, policy: MediaPolicy, source: str) -> VideoHeader:
    if not container.streams.video:
        raise MediaDecodeError(f"video {source!r} has no video stream", source=source)
    stream = container.streams.video[0]
    width, height = int(stream.codec_context.width), int(stream.codec_context.height)
    if width <= 0 or height <= 0:
        raise MediaDecodeError(f"video {source!r} declares an empty frame size", source=source)
    if width * height > policy.max_pixels:
        raise MediaPolicyError(
            f"video {source!r} frames are {width}x{height} = {width * height} pixels, "
            f"over max_pixels={policy.max_pixels}",
            source=source,
        )
    duration = _declared_duration(container, stream, policy, source, "video")
    frames = int(stream.frames) if stream.frames else None
    rate = float(stream.average_rate) if stream.average_rate else None
    return VideoHeader(
        container=fmt,
        codec=str(stream.codec_context.name),
        width=width,
        height=height,
        duration_s=duration,
        num_frames=frames,
        average_fps=rate,
    )


def _open_video(raw: bytes, source: str) -> tuple[Any, str]:
    import av

    fmt = _video_container(raw, source)
    _check_declared_size(raw, fmt, source)
    return av.open(io.BytesIO(raw), mode="r", format=fmt), fmt


def probe_video(raw: bytes, policy: MediaPolicy, source: str) -> VideoHeader:
    """Container, codec, frame size and duration from the header; no frame is decoded."""
    with _mapped("video", source):
        container, fmt = _open_video(raw, source)
        with container:
            return _video_header(container, fmt, policy, source)


def _sample_times(duration: float | None, fps: float, max_frames: int) -> float:
    """The sampling step in seconds: ``1/fps``, widened so a known duration yields <= max_frames."""
    step = 1.0 / fps
    if duration is not None and duration > 0 and math.ceil(duration / step) > max_frames:
        step = duration / max_frames
    return step


def decode_video(
    raw: bytes,
    policy: MediaPolicy,
    source: str,
    *,
    fps: float | None = None,
    max_frames: int | None = None,
) -> VideoClip:
    """Decode the first video stream, sampling at ``fps`` (default ``policy.video_fps``).

    At most ``max_frames`` (default ``policy.max_frames``) frames are returned;
    when the clip is long enough to exceed it, the sampling step widens to
    ``duration / max_frames`` so the frames still cover the whole clip. (A stream
    whose header gives no duration keeps the first ``max_frames`` samples and logs
    a warning naming how many were dropped.)
    """
    fps = policy.video_fps if fps is None else fps
    max_frames = policy.max_frames if max_frames is None else max_frames
    if fps <= 0 or max_frames <= 0:
        raise ValueError("fps and max_frames must be positive")
    with _mapped("video", source):
        container, fmt = _open_video(raw, source)
        with container:
            header = _video_header(container, fmt, policy, source)
            stream = container.streams.video[0]
            step = _sample_times(header.duration_s, fps, max_frames)
            expected = max_frames
            if header.duration_s is not None:
                expected = min(max_frames, max(1, math.ceil(header.duration_s / step)))
            frame_bytes = header.width * header.height * 3
            if expected * frame_bytes > policy.max_decoded_bytes:
                raise MediaPolicyError(
                    f"video {source!r} would decode to {expected} frames of {header.width}x{header.height} "
                    f"= {expected * frame_bytes} bytes, over max_decoded_bytes={policy.max_decoded_bytes}",
                    source=source,
                )
            start = float(stream.start_time * stream.time_base) if stream.start_time is not None else 0.0
            kept: list[npt.NDArray[np.uint8]] = []
            times: list[float] = []
            next_t = 0.0
            decoded = 0
            dropped = 0
            for frame in container.decode(stream):
                decoded += 1
                if frame.time is not None:
                    t = float(frame.time) - start
                elif header.average_fps:
                    t = (decoded - 1) / header.average_fps
                else:
                    t = (decoded - 1) * step
                if t > policy.max_duration_s:
                    raise MediaPolicyError(
                        f"video {source!r} runs past max_duration_s={policy.max_duration_s}", source=source
                    )
                if t + 1e-6 >= next_t and len(kept) >= max_frames:
                    dropped += 1  # only when the duration was unknown up front
                    next_t = (math.floor((t + 1e-6) / step) + 1) * step
                elif t + 1e-6 >= next_t:
                    pixels = frame.width * frame.height
                    if pixels > policy.max_pixels or pixels * 3 * (len(kept) + 1) > policy.max_decoded_bytes:
                        raise MediaPolicyError(
                            f"video {source!r}: frame {decoded - 1} is {frame.width}x{frame.height}, over "
                            f"max_pixels={policy.max_pixels} or max_decoded_bytes={policy.max_decoded_bytes}",
                            source=source,
                        )
                    if kept and (frame.height, frame.width) != kept[0].shape[:2]:
                        raise MediaDecodeError(
                            f"video {source!r}: frame size changes mid-stream "
                            f"({kept[0].shape[1]}x{kept[0].shape[0]} -> {frame.width}x{frame.height})",
                            source=source,
                        )
                    kept.append(frame.to_ndarray(format="rgb24"))
                    times.append(t)
                    next_t = (math.floor((t + 1e-6) / step) + 1) * step
            if decoded == 0:
                raise MediaDecodeError(
                    f"video {source!r} is truncated or corrupt: no frame decodes", source=source
                )
            if header.num_frames is not None and decoded < header.num_frames:
                raise MediaDecodeError(
                    f"video {source!r} is truncated: decoded {decoded} of "
                    f"{header.num_frames} declared frames",
                    source=source,
                )
            if dropped:
                logger.warning(
                    "video %s: duration unknown in the header; kept the first %d sampled frames "
                    "(max_frames) and dropped %d later ones",
                    source,
                    len(kept),
                    dropped,
                )
            return VideoClip(frames=np.stack(kept), timestamps_s=np.asarray(times, dtype=np.float64))


# ----------------------------------------------------------------------------- dispatch


def probe(
    raw: bytes, modality: str, policy: MediaPolicy, source: str
) -> ImageHeader | AudioHeader | VideoHeader:
    """Header check for ``modality``; see the ``probe_*`` functions."""
    if modality == "image":
        return probe_image(raw, policy, source)
    if modality == "audio":
        return probe_audio(raw, policy, source)
    if modality == "video":
        return probe_video(raw, policy, source)
    raise ValueError(f"unknown modality {modality!r} (expected 'image', 'audio' or 'video')")
