"""beep_count task data: a synthesized WAV with N beeps, and the reward.

The clip is mono 16-bit PCM at ``sample_rate`` Hz: ``num_beeps`` sine beeps (10 ms
raised-cosine fades, so no clicks read as extra beeps) over a faint seeded noise floor.
Audio reaches the model as stock Gym sends it: a ``data:audio/wav`` URI in
``responses_create_params.metadata.audio_data`` (it applies to the first turn). With
``audio_via="part"`` it travels instead as an ``input_audio`` part of the user message
(``{"input_audio": {"data", "format": "wav"}}``; gymbridge accepts it, stock Gym's
strict input validation may not). Never both, so the clip is counted once per rollout.

Invariants: beeps never overlap and are separated by at least ``min_gap_s`` of
silence; every beep lies wholly inside the clip; ``num_beeps`` in the row equals the
number of beeps rendered (``beep_onsets_s`` lists them).
"""

from __future__ import annotations

import base64
import io
import random
from collections.abc import Iterator, Sequence
from typing import Annotated, Any, Literal

import numpy as np
import soundfile as sf
from pydantic import Field

from gymbridge.media import encode_data_url
from gymbridge_envs._common import row_rng

ENV_NAME = "beep_count"

SYSTEM_PROMPT = (
    "You are an audio assistant. Listen to the audio clip and count the short beeps in it. "
    "Call the answer tool with the count, or reply with <answer>N</answer>."
)


MAX_TURNS = 2
"""Model calls an episode may take (a run's ``rollout.max_turns`` when it sets none)."""
SMOKE_PARAMS: dict[str, Any] = {"duration_s": 1.0, "max_beeps": 3}
"""Generator parameters of ``gymbridge smoke run --env beep_count`` (small, for the tiny model)."""


def tools() -> list[dict[str, Any]]:
    """The function tools the server publishes: one source of truth, the server's typed tools."""
    from gymbridge_envs.beep_count.server import BeepCountServer

    return BeepCountServer.function_tools()


def beep_onsets(
    rng: random.Random, num_beeps: int, duration_s: float, beep_s: float, min_gap_s: float
) -> list[float]:
    """Sorted onsets (s) of ``num_beeps`` beeps that fit the clip with the required gaps."""
    slack = duration_s - num_beeps * beep_s - (num_beeps + 1) * min_gap_s
    if slack < 0:
        raise ValueError(f"{num_beeps} beeps of {beep_s}s with {min_gap_s}s gaps do not fit {duration_s}s")
    # Split the slack into num_beeps + 1 random shares: gaps stay >= min_gap_s.
    cuts = sorted(rng.uniform(0.0, slack) for _ in range(num_beeps))
    shares = [b - a for a, b in zip([0.0, *cuts[:-1]], cuts, strict=True)]
    onsets, t = [], 0.0
    for share in shares:
        t += min_gap_s + share
        onsets.append(round(t, 4))
        t += beep_s
    return onsets


def synthesize(
    onsets_s: Sequence[float],
    *,
    duration_s: float,
    beep_s: float,
    freq_hz: float,
    sample_rate: int,
    noise_seed: int,
    noise_level: float = 0.004,
) -> np.ndarray:
    """The clip as float32 samples in [-1, 1], shape ``[round(duration_s * sample_rate)]``."""
    total = round(duration_s * sample_rate)
    noise = np.random.default_rng(noise_seed).standard_normal(total).astype(np.float32)
    signal = noise * np.float32(noise_level)
    n = round(beep_s * sample_rate)
    t = np.arange(n, dtype=np.float64) / sample_rate
    tone = 0.5 * np.sin(2 * np.pi * freq_hz * t)
    fade = min(n // 2, round(0.010 * sample_rate))
    ramp = 0.5 - 0.5 * np.cos(np.linspace(0.0, np.pi, fade))
    tone[:fade] *= ramp
    tone[n - fade :] *= ramp[::-1]
    for onset in onsets_s:
        start = round(onset * sample_rate)
        signal[start : start + n] += tone[: total - start].astype(np.float32)
    clipped: np.ndarray = np.clip(signal, -1.0, 1.0)
    return clipped


def wav_bytes(samples: np.ndarray, sample_rate: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, sample_rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def make_row(
    seed: int,
    index: int,
    *,
    min_beeps: Annotated[int, Field(ge=0)] = 1,
    max_beeps: Annotated[int, Field(ge=0)] = 6,
    duration_s: Annotated[float, Field(gt=0, le=600)] = 3.0,
    beep_s: Annotated[float, Field(gt=0)] = 0.12,
    min_gap_s: Annotated[float, Field(ge=0)] = 0.15,
    sample_rate: Annotated[int, Field(ge=1000, le=192000)] = 16000,
    audio_via: Literal["metadata", "part"] = "metadata",
) -> dict[str, Any]:
    """Row ``index`` of the dataset generated with ``seed``."""
    rng = row_rng(ENV_NAME, seed, index)
    num_beeps = rng.randint(min_beeps, max_beeps)
    onsets = beep_onsets(rng, num_beeps, duration_s, beep_s, min_gap_s)
    freq_hz = float(rng.choice([440, 554, 660, 880, 988, 1175]))
    samples = synthesize(
        onsets,
        duration_s=duration_s,
        beep_s=beep_s,
        freq_hz=freq_hz,
        sample_rate=sample_rate,
        noise_seed=rng.randrange(2**32),
    )
    raw = wav_bytes(samples, sample_rate)
    user_content: list[dict[str, Any]] = [
        {"type": "input_text", "text": "How many beeps are there in the audio clip?"}
    ]
    params: dict[str, Any] = {}
    if audio_via == "part":
        user_content.insert(
            0,
            {"type": "input_audio", "input_audio": {"data": base64.b64encode(raw).decode(), "format": "wav"}},
        )
    elif audio_via == "metadata":
        params["metadata"] = {"audio_data": encode_data_url(raw, "audio/wav")}
    else:
        raise ValueError(f"audio_via must be 'metadata' or 'part', got {audio_via!r}")
    return {
        "responses_create_params": {
            "input": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": user_content},
            ],
            "tools": tools(),
            **params,
        },
        "num_beeps": num_beeps,
        "beep_onsets_s": onsets,
        "beep_freq_hz": freq_hz,
        "duration_s": duration_s,
    }


def generate(n: int, seed: int = 0, **params: Any) -> Iterator[dict[str, Any]]:
    for index in range(n):
        yield make_row(seed, index, **params)


def count_beeps(samples: np.ndarray, sample_rate: int, threshold: float = 0.1) -> int:
    """Count beeps in ``samples`` by envelope thresholding (a reference solver for tests)."""
    hop = max(1, sample_rate // 200)  # 5 ms frames
    usable = len(samples) // hop * hop
    frames = np.abs(samples[:usable]).reshape(-1, hop).max(axis=1)
    loud = frames > threshold
    return int(np.count_nonzero(loud[1:] & ~loud[:-1]) + int(loud[0]))
