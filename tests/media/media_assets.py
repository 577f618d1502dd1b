"""Media test assets generated in code (no binary files checked in).

Everything is small (tens of pixels, a fraction of a second) so the media suite
stays fast. Imported by the media tests and their conftest.
"""

from __future__ import annotations

import io
import struct
import zlib
from dataclasses import dataclass, field

import av
import numpy as np
import soundfile as sf
from PIL import Image


def png_bytes(width: int = 24, height: int = 16, mode: str = "RGB", seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}[mode]
    arr = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, mode=mode).save(buf, format="PNG")
    return buf.getvalue()


def jpeg_bytes(width: int = 32, height: int = 16, orientation: int | None = None) -> bytes:
    """A JPEG whose left half is red and right half blue; optional EXIF orientation tag."""
    arr = np.zeros((height, width, 3), dtype=np.uint8)
    arr[:, : width // 2] = (255, 0, 0)
    arr[:, width // 2 :] = (0, 0, 255)
    img = Image.fromarray(arr)
    buf = io.BytesIO()
    if orientation is None:
        img.save(buf, format="JPEG", quality=95)
    else:
        exif = Image.Exif()
        exif[0x0112] = orientation
        img.save(buf, format="JPEG", quality=95, exif=exif.tobytes())
    return buf.getvalue()


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def bomb_png(width: int, height: int) -> bytes:
    """A tiny, well-formed PNG file that *declares* ``width x height`` RGB pixels."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return (
        b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")
    )


def corrupt_idat_png() -> bytes:
    """Valid signature, IHDR and CRCs, but IDAT holds garbage instead of zlib data."""
    ihdr = struct.pack(">IIBBBBB", 8, 8, 8, 2, 0, 0, 0)
    garbage = bytes(range(200))
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", garbage)
        + png_chunk(b"IEND", b"")
    )


def tone(seconds: float = 0.25, rate: int = 16000, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    wave = (0.5 * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32)
    return wave if channels == 1 else np.stack([wave] * channels, axis=1)


def audio_bytes(fmt: str = "WAV", seconds: float = 0.25, rate: int = 16000, channels: int = 1) -> bytes:
    buf = io.BytesIO()
    subtype = "PCM_16"
    sf.write(buf, tone(seconds, rate, channels), rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def mp4_bytes(num_frames: int = 20, fps: int = 10, size: int = 32) -> bytes:
    """An H.264 (or MPEG-4) MP4 whose frame i is a flat grey of level ``10 * i mod 256``."""
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    return video_bytes("mp4", codec, num_frames=num_frames, fps=fps, size=size)


def video_bytes(fmt: str, codec: str, num_frames: int = 20, fps: int = 10, size: int = 32) -> bytes:
    """A ``fmt`` container (mp4, matroska, webm, avi) of ``codec`` frames, frame i grey ``10 * i``."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width = size
        stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(num_frames):
            frame = av.VideoFrame.from_ndarray(
                np.full((size, size, 3), (10 * i) % 256, np.uint8), format="rgb24"
            )
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


@dataclass
class MediaServer:
    """Loopback server state: its port, the files it serves and every request it received."""

    port: int
    files: dict[str, bytes]
    requests: list[tuple[str, str | None]] = field(default_factory=list)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


def av_audio_bytes(fmt: str = "mp4", codec: str = "aac", seconds: float = 1.0, rate: int = 16000) -> bytes:
    """A ``tone()`` encoded by PyAV into ``fmt`` (mp4 = m4a, webm, matroska)."""
    wave = tone(seconds, rate)
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.layout = "mono"
        for start in range(0, len(wave), 960):
            frame = av.AudioFrame.from_ndarray(
                wave[None, start : start + 960].copy(), format="flt", layout="mono"
            )
            frame.sample_rate = rate
            frame.pts = start
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()
