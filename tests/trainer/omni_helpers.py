"""Helpers for the image + video + audio tests: media bytes, a mixed-media environment, exactness."""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np
import soundfile as sf
import torch
from PIL import Image

from gymbridge.generation.hf import HFGenerator
from gymbridge.media import encode_data_url
from gymbridge.server import ResourcesServer, Session, ToolOutput, VerifyResult, audio_part, tool, video_part


def png_bytes(color: tuple[int, int, int] = (200, 30, 30), size: int = 56) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, "PNG")
    return buf.getvalue()


def wav_bytes(seconds: float = 1.5, rate: int = 22050, freq_hz: float = 660.0) -> bytes:
    """A sine tone; 22.05 kHz on purpose, so the 16 kHz feature extractor's resampling is exercised."""
    t = np.arange(round(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * freq_hz * t)).astype(np.float32), rate, format="WAV")
    return buf.getvalue()


def mp4_bytes(num_frames: int = 6, size: int = 64, fps: int = 2) -> bytes:
    """A moving square, H.264 in MP4 (the bouncing_ball encoder)."""
    from gymbridge_envs.bouncing_ball.data import encode_mp4

    frames = np.zeros((num_frames, size, size, 3), dtype=np.uint8)
    for i in range(num_frames):
        frames[i, 8 + 4 * i : 20 + 4 * i, 10:22] = (255, 255, 0)
    return encode_mp4(frames, fps)


class MixedMediaServer(ResourcesServer):
    """``listen`` returns an audio clip, ``watch`` a video; the row's prompt holds an image."""

    async def seed_session(self, session: Session, row: dict[str, Any]) -> dict[str, Any]:
        return {}

    @tool
    async def listen(self, session: Session) -> ToolOutput:
        """Play the sound."""
        return ToolOutput(text="Here is the sound.", media=[audio_part(wav_bytes())])

    @tool
    async def watch(self, session: Session) -> ToolOutput:
        """Play the video."""
        return ToolOutput(text="Here is the video.", media=[video_part(mp4_bytes())])

    async def verify(self, session: Session, row: dict[str, Any], response: dict[str, Any]) -> VerifyResult:
        return VerifyResult(reward=1.0)


def mixed_row(max_output_tokens: int = 10, temperature: float = 0.8) -> dict[str, Any]:
    return {
        "responses_create_params": {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "input_image",
                            "image_url": encode_data_url(png_bytes(), "image/png"),
                            "detail": "auto",
                        },
                        {"type": "input_text", "text": "Listen, then watch, then answer."},
                    ],
                }
            ],
            "tools": [
                {
                    "type": "function",
                    "name": n,
                    "description": n,
                    "parameters": {"type": "object", "properties": {}},
                }
                for n in ("listen", "watch")
            ],
            "max_output_tokens": max_output_tokens,
            "temperature": temperature,
        }
    }


def call_tokens(gen: HFGenerator, name: str) -> list[int]:
    """A Hermes tool call of ``name`` (no arguments), ended by the end-of-turn token."""
    text = "<tool_call>\n" + json.dumps({"name": name, "arguments": {}}) + "\n</tool_call>"
    return [int(t) for t in gen.tokenizer(text, add_special_tokens=False)["input_ids"]] + [
        gen.codec.end_of_turn_id
    ]


def trainer_max_logprob_diff(
    model: Any, processor: Any, trajectories: list[Any], temperature: float
) -> float:
    """Max |generation logprob - trainer's teacher-forced logprob| over every trained token of a batch."""
    from gymbridge.tensors import MediaProcessor, TrainBatch
    from gymbridge.trainer.grpo import token_logprobs

    batch = TrainBatch.from_trajectories(
        trajectories, MediaProcessor(processor), group_size=len(trajectories)
    )
    with torch.no_grad():
        new = token_logprobs(model, batch, temperature=temperature)
    mask = batch.loss_mask > 0
    assert bool(mask.any())
    return float((new[mask] - batch.logprobs[mask]).abs().max())
