"""Video and audio through ``MediaProcessor`` and into the trainer's forward, on the tiny omni model."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
for extra in (ROOT, ROOT / "tests" / "trainer"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from omni_helpers import mp4_bytes, png_bytes, wav_bytes  # noqa: E402

from gymbridge.errors import ProtocolError, TrajectoryError  # noqa: E402
from gymbridge.media import MediaItem, encode_data_url, load_media  # noqa: E402
from gymbridge.models.tiny_omni import TinyOmni, TinyVideoProcessor  # noqa: E402
from gymbridge.tensors import MediaProcessor, TrainBatch  # noqa: E402
from gymbridge.tensors.processor import audio_output_length, forward_media_kwargs  # noqa: E402
from gymbridge.trajectory import Trajectory, Turn  # noqa: E402


def media(kind: str, raw: bytes) -> MediaItem:
    mime = {"image": "image/png", "audio": "audio/wav", "video": "video/mp4"}[kind]
    return load_media(encode_data_url(raw, mime), kind)  # type: ignore[arg-type]


def test_video_frames_are_grouped_by_the_temporal_patch() -> None:
    """5 frames -> padded to 6 by repeating the last -> grid_t 3; frame pairs share a patch row."""
    frames = np.stack([np.full((64, 64, 3), 40 * i, dtype=np.uint8) for i in range(5)])
    out = TinyVideoProcessor()(videos=[frames])
    assert out["video_grid_thw"].tolist() == [[3, 4, 4]]  # 64 px -> 56 px -> 4 x 4 patches of 14
    pv = out["pixel_values_videos"]
    assert pv.shape == (3 * 4 * 4, 3 * 2 * 14 * 14)
    # columns are [C, temporal, 14, 14]: the red channel of the two frames of temporal patch t
    cols = pv.reshape(48, 3, 2, 14 * 14)[:, 0, :, 0]
    per_grid = cols.reshape(3, 16, 2)[:, 0, :]  # one row of each temporal patch
    assert per_grid[0, 0] < per_grid[0, 1] < per_grid[1, 0] < per_grid[1, 1] < per_grid[2, 0]
    assert per_grid[2, 0] == per_grid[2, 1]  # the padded frame repeats frame 4


def test_audio_features_come_from_the_whisper_extractor_and_are_resampled(tiny_omni: TinyOmni) -> None:
    proc = MediaProcessor(tiny_omni.processor)
    clip = media("audio", wav_bytes(seconds=1.5, rate=22050))
    out = proc.process([clip])[clip.key]
    assert type(proc.sub_processor("audio")).__name__ == "WhisperFeatureExtractor"
    assert set(out.outputs) == {"input_features", "feature_attention_mask"}  # never "attention_mask"
    assert out.outputs["input_features"].shape == (1, 16, 400)  # 16 mel bins, padded to 4 s
    frames = int(out.outputs["feature_attention_mask"].sum())
    assert frames == 150  # 1.5 s at 16 kHz after resampling from 22.05 kHz, 100 frames per second
    assert out.num_placeholders == audio_output_length(frames) == 37


def test_video_gets_its_timing_key_and_its_placeholder_count(tiny_omni: TinyOmni) -> None:
    proc = MediaProcessor(tiny_omni.processor)
    video = media("video", mp4_bytes(num_frames=6, fps=2))
    out = proc.process([video])[video.key]
    assert set(out.outputs) == {"pixel_values_videos", "video_grid_thw", "video_second_per_grid"}
    assert out.outputs["video_second_per_grid"].tolist() == [1.0]  # temporal patch 2 / 2 fps
    grid = out.outputs["video_grid_thw"][0].tolist()
    assert out.num_placeholders == grid[0] * grid[1] * grid[2] // 4


@pytest.mark.parametrize("kind", ["audio", "video"])
def test_each_content_key_is_processed_once_per_group_and_shared(tiny_omni: TinyOmni, kind: str) -> None:
    """G = 16 copies of one clip (separately loaded): one processor call, one segment per key."""
    raw = wav_bytes() if kind == "audio" else mp4_bytes()
    proc = MediaProcessor(tiny_omni.processor)
    copies = [media(kind, raw) for _ in range(16)]
    processed = proc.process(copies)
    assert len(processed) == 1 and proc.stats.items_processed == 1 and proc.stats.items_requested == 16


def test_timing_key_takes_the_models_spelling_or_is_dropped() -> None:
    seconds = {"video_second_per_grid": torch.tensor([1.0])}
    assert set(forward_media_kwargs(seconds, ["second_per_grid_ts"])) == {"second_per_grid_ts"}  # Qwen2.5-VL
    assert forward_media_kwargs(seconds, ["pixel_values_videos"]) == {}  # Qwen2-VL takes no timing key
    assert set(forward_media_kwargs(seconds, ["video_second_per_grid"])) == {"video_second_per_grid"}


def _audio_batch(tiny_omni: TinyOmni) -> tuple[TrainBatch, list[int]]:
    clip = media("audio", wav_bytes(seconds=1.0, rate=16000))
    n = audio_output_length(100)
    tok = tiny_omni.tokenizer
    prompt = [*tok("hi", add_special_tokens=False)["input_ids"], 13, *([tiny_omni.audio_token_id] * n), 15]
    turn = Turn(0, 0, "message", 0, prompt, [20, 21, 22], [-1.0, -1.0, -1.0], media=[clip])
    traj = Trajectory(turns=[turn], reward=1.0)
    batch = TrainBatch.from_trajectories([traj, traj], MediaProcessor(tiny_omni.processor), group_size=2)
    return batch, prompt


def test_audio_feature_mask_never_overwrites_text_attention_mask(tiny_omni: TinyOmni) -> None:
    """Regression: the extractor's ``attention_mask`` ([N, 400] frames) used to reach the model as the
    *text* attention mask. It is ``feature_attention_mask`` now, and the text mask always wins."""
    from gymbridge.trainer.forward import forward_kwargs as _forward_kwargs

    batch, _ = _audio_batch(tiny_omni)
    assert "attention_mask" not in batch.media and "feature_attention_mask" in batch.media
    kwargs: dict[str, Any] = _forward_kwargs(tiny_omni.model, batch)
    assert torch.equal(kwargs["attention_mask"], batch.attention_mask)
    assert kwargs["feature_attention_mask"].shape == (2, 400)
    # a media key spelled like a token-stream input is refused, never passed
    bad = TrainBatch(
        **{
            **batch.__dict__,
            "media": {**batch.media, "attention_mask": batch.media["feature_attention_mask"]},
        }
    )
    with pytest.raises(TrajectoryError, match="attention_mask"):
        _forward_kwargs(tiny_omni.model, bad)
    with pytest.raises(ValueError, match="attention_mask"):
        forward_media_kwargs({"attention_mask": torch.ones(1, 4)}, ["attention_mask"])


def test_audio_placeholder_count_is_checked_per_turn(tiny_omni: TinyOmni) -> None:
    batch, prompt = _audio_batch(tiny_omni)
    assert batch.media_keys() == {"audio": ["feature_attention_mask", "input_features"]}
    assert len(batch.media_content_keys()["audio"]) == 1
    clip = media("audio", wav_bytes(seconds=1.0, rate=16000))
    short = prompt[:-2] + prompt[-1:]  # one audio placeholder fewer than the clip needs
    traj = Trajectory(turns=[Turn(0, 0, "message", 0, short, [20], [-1.0], media=[clip])], reward=0.0)
    with pytest.raises(TrajectoryError, match=r"audio placeholder token\(s\) but its 1 audio\(s\) need 25"):
        TrainBatch.from_trajectories([traj], MediaProcessor(tiny_omni.processor), group_size=1)


async def test_generator_refuses_audio_or_video_out_of_step_with_the_prompt(tiny_omni_gen: Any) -> None:
    from gymbridge.generation.types import SamplingConfig
    from gymbridge.trajectory.types import GenerationInput

    clip = media("audio", wav_bytes(seconds=1.0, rate=16000)).audio()
    video = media("video", mp4_bytes()).video()
    image = media("image", png_bytes()).image()
    text_only = [20, 21, 22]
    for mm in ({"audio": [clip]}, {"video": [video]}, {"image": [image]}):
        with pytest.raises(ProtocolError, match="out of step"):
            await tiny_omni_gen.generate([GenerationInput(text_only, mm)], SamplingConfig(max_tokens=2))
    with pytest.raises(ProtocolError, match="no audio clips were given"):
        await tiny_omni_gen.generate(
            [GenerationInput([20, tiny_omni_gen.audio_token_id, 21])], SamplingConfig(max_tokens=2)
        )


@settings(max_examples=25, deadline=None)
@given(frames=st.integers(1, 7), height=st.integers(20, 90), width=st.integers(20, 90))
def test_video_grid_covers_every_frame_pair_and_agrees_with_its_tensor(
    frames: int, height: int, width: int
) -> None:
    from gymbridge.tensors.processor import num_placeholders, process_decoded

    sub = TinyVideoProcessor()
    out = process_decoded("video", sub, np.zeros((frames, height, width, 3), dtype=np.uint8))
    t, h, w = out["video_grid_thw"][0].tolist()
    assert t == (frames + 1) // 2 and h % 2 == 0 and w % 2 == 0
    assert out["pixel_values_videos"].shape == (t * h * w, 3 * 2 * 14 * 14)
    assert num_placeholders("video", out, sub) == t * h * w // 4
    assert h * w * 14 * 14 <= 56 * 56 or (h, w) == (2, 2)  # the pixel cap holds


@settings(max_examples=50, deadline=None)
@given(frames=st.integers(1, 3000))
def test_audio_token_count_is_the_models_own(frames: int) -> None:
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder

    _, expected = Qwen2_5OmniAudioEncoder._get_feat_extract_output_lengths(None, torch.tensor(frames))  # type: ignore[arg-type]
    assert audio_output_length(frames) == int(expected)
