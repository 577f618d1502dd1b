"""bouncing_ball task data: a rendered MP4 of a ball bouncing in a box, and the reward.

The ball moves at constant velocity and reflects off the four walls; a **bounce** is one
reflection. The simulation runs frame by frame, so every counted bounce is visible in the
rendered frames. Scenes where the ball would hit two walls in one frame (a corner, which
a viewer could count as one or two) are rejected and resampled.

The video reaches the model as an ``input_video`` part of the user message: a
``data:video/mp4`` URL by default, or a ``file://`` URL when ``video_dir`` is given
(the MP4 is written there). H.264 (libx264, yuv420p, fixed quantiser), encoded single-threaded from our own
colour conversion so the bytes are deterministic.

Invariants: ``num_bounces`` equals the bounces in the rendered frames; the clip has
exactly ``num_frames = round(duration_s * fps)`` frames of ``size`` x ``size`` pixels.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any

import av
import numpy as np
from pydantic import Field

from gymbridge.media import encode_data_url
from gymbridge_envs._common import row_rng

ENV_NAME = "bouncing_ball"

SYSTEM_PROMPT = (
    "You are a video assistant. Watch the video of a ball moving inside a box and count how many times it "
    "bounces off a wall. Call the answer tool with the count, or reply with <answer>N</answer>."
)


MAX_TURNS = 2
"""Model calls an episode may take (a run's ``rollout.max_turns`` when it sets none)."""
SMOKE_PARAMS: dict[str, Any] = {"size": 32, "fps": 4, "duration_s": 1.0}
"""Generator parameters of ``gymbridge smoke run --env bouncing_ball`` (small, for the tiny model)."""


def tools() -> list[dict[str, Any]]:
    """The function tools the server publishes: one source of truth, the server's typed tools."""
    from gymbridge_envs.bouncing_ball.server import BouncingBallServer

    return BouncingBallServer.function_tools()


def simulate(
    start: Sequence[float], velocity: Sequence[float], *, num_frames: int, size: int, radius: int
) -> tuple[list[tuple[float, float]], int, bool]:
    """Ball centres per frame, the bounce count, and whether a corner (double) bounce happened."""
    x, y = float(start[0]), float(start[1])
    vx, vy = float(velocity[0]), float(velocity[1])
    lo, hi = float(radius), float(size - 1 - radius)
    positions = [(x, y)]
    bounces, corner = 0, False
    for _ in range(num_frames - 1):
        x, y = x + vx, y + vy
        hit = 0
        if x < lo or x > hi:
            x = 2 * lo - x if x < lo else 2 * hi - x
            vx, hit = -vx, hit + 1
        if y < lo or y > hi:
            y = 2 * lo - y if y < lo else 2 * hi - y
            vy, hit = -vy, hit + 1
        bounces += hit
        corner = corner or hit > 1
        positions.append((x, y))
    return positions, bounces, corner


def render_frames(positions: Sequence[tuple[float, float]], *, size: int, radius: int) -> np.ndarray:
    """Frames ``[T, size, size, 3]`` uint8: a dark box with a light border and an orange ball."""
    frames = np.zeros((len(positions), size, size, 3), dtype=np.uint8)
    frames[:] = (24, 28, 40)
    frames[:, [0, -1], :] = (200, 200, 200)
    frames[:, :, [0, -1]] = (200, 200, 200)
    yy, xx = np.mgrid[0:size, 0:size]
    for t, (cx, cy) in enumerate(positions):
        disk = (xx - cx) ** 2 + (yy - cy) ** 2 <= radius**2
        frames[t][disk] = (255, 150, 40)
    return frames


def rgb_to_yuv420p(frame: np.ndarray) -> np.ndarray:
    """BT.601 limited-range YUV 4:2:0 planes stacked as ``[H * 3 / 2, W]`` uint8 (even H, W).

    Done here in integer-exact numpy rather than by swscale inside the encoder, so the
    encoder's input, and hence the MP4 bytes, cannot vary between runs.
    """
    rgb = frame.astype(np.int32)
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    y = ((66 * r + 129 * g + 25 * b + 128) >> 8) + 16
    # Chroma from the 2x2 block means (rounded), as 4:2:0 subsampling needs.
    h, w = frame.shape[0] // 2, frame.shape[1] // 2
    rb = (rgb.reshape(h, 2, w, 2, 3).sum(axis=(1, 3)) + 2) >> 2
    r2, g2, b2 = rb[..., 0], rb[..., 1], rb[..., 2]
    u = ((-38 * r2 - 74 * g2 + 112 * b2 + 128) >> 8) + 128
    v = ((112 * r2 - 94 * g2 - 18 * b2 + 128) >> 8) + 128
    planes = np.concatenate([y.reshape(-1), u.reshape(-1), v.reshape(-1)])
    out: np.ndarray = (
        np.clip(planes, 0, 255).astype(np.uint8).reshape(frame.shape[0] * 3 // 2, frame.shape[1])
    )
    return out


def encode_mp4(frames: np.ndarray, fps: int) -> bytes:
    """H.264 MP4 bytes of ``frames`` ``[T, H, W, 3]`` (even H, W).

    Deterministic: our own colour conversion, one encoder thread, a fixed quantiser and
    no float-driven rate-control heuristics (mbtree, psy, adaptive quantisation).
    """
    if frames.shape[1] % 2 or frames.shape[2] % 2:
        raise ValueError(f"frame size must be even for yuv420p, got {frames.shape[2]}x{frames.shape[1]}")
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps, 1))
        stream.width, stream.height = int(frames.shape[2]), int(frames.shape[1])
        stream.pix_fmt = "yuv420p"
        stream.codec_context.thread_count = 1
        stream.codec_context.options = {
            "preset": "veryfast",
            "threads": "1",
            "x264-params": "qp=20:mbtree=0:psy=0:aq-mode=0:weightp=0:rc-lookahead=0:sliced-threads=0",
        }
        for frame in frames:
            video_frame = av.VideoFrame.from_ndarray(rgb_to_yuv420p(frame), format="yuv420p")
            for packet in stream.encode(video_frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def make_row(
    seed: int,
    index: int,
    *,
    size: Annotated[int, Field(ge=16, le=1024)] = 64,
    fps: Annotated[int, Field(ge=1, le=60)] = 8,
    duration_s: Annotated[float, Field(gt=0, le=60)] = 3.0,
    radius: Annotated[int, Field(ge=1)] = 4,
    max_bounces: Annotated[int, Field(ge=0)] = 8,
    video_dir: str | None = None,
) -> dict[str, Any]:
    """Row ``index`` of the dataset generated with ``seed``."""
    rng = row_rng(ENV_NAME, seed, index)
    num_frames = round(duration_s * fps)
    target = rng.randint(0, max_bounces)  # aim at a uniform spread of answers
    best: tuple[int, list[tuple[float, float]]] | None = None
    for _attempt in range(400):
        start = (rng.uniform(radius + 1, size - 2 - radius), rng.uniform(radius + 1, size - 2 - radius))
        speed = rng.uniform(1.0, 12.0)
        angle = rng.uniform(0, 2 * np.pi)
        velocity = (round(speed * float(np.cos(angle)), 3), round(speed * float(np.sin(angle)), 3))
        positions, bounces, corner = simulate(
            start, velocity, num_frames=num_frames, size=size, radius=radius
        )
        if corner:
            continue
        if best is None or abs(bounces - target) < abs(best[0] - target):
            best = (bounces, positions)
        if bounces == target:
            break
    if best is None:
        raise ValueError("could not sample a scene without corner bounces")
    bounces, positions = best
    raw = encode_mp4(render_frames(positions, size=size, radius=radius), fps)
    if video_dir is not None:
        path = Path(video_dir).resolve() / f"{ENV_NAME}-{seed}-{index}.mp4"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(raw)
        video_url = path.as_uri()
    else:
        video_url = encode_data_url(raw, "video/mp4")
    return {
        "responses_create_params": {
            "input": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {
                    "role": "user",
                    "content": [
                        {"type": "input_video", "video_url": video_url},
                        {"type": "input_text", "text": "How many times does the ball bounce off a wall?"},
                    ],
                },
            ],
            "tools": tools(),
        },
        "num_bounces": bounces,
        "num_frames": num_frames,
        "fps": fps,
    }


def generate(n: int, seed: int = 0, **params: Any) -> Iterator[dict[str, Any]]:
    for index in range(n):
        yield make_row(seed, index, **params)
