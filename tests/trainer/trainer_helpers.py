"""Builders for the trainer tests: tiny-model batches of media prompts with scripted completions."""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from PIL import Image

from gymbridge.media import MediaItem
from gymbridge.models.tiny_vlm import TinyVLM
from gymbridge.tensors import MediaProcessor, TrainBatch
from gymbridge.trajectory.types import Trajectory, Turn

TEXT = [40, 41, 42, 43]


def image(color: tuple[int, int, int]) -> MediaItem:
    buf = io.BytesIO()
    img = Image.new("RGB", (56, 56), color)
    img.putpixel((3, 5), (color[0] ^ 255, 7, 9))
    img.save(buf, format="PNG")
    return MediaItem.from_bytes(buf.getvalue(), "image", mime="image/png")


def trajectory(
    tiny: TinyVLM, media: MediaItem, gen: list[int], reward: float, task: int, rollout: int
) -> Trajectory:
    prompt = [tiny.im_start_token_id, *TEXT, tiny.vision_start_token_id, *[tiny.image_token_id] * 4]
    prompt += [tiny.vision_end_token_id, 44, 45]
    return one_turn(prompt, gen, [media], reward=reward, task=task, rollout=rollout)


def one_turn(
    prompt: list[int], gen: list[int], media: Sequence[MediaItem], *, reward: float, task: int, rollout: int
) -> Trajectory:
    """A one-turn trajectory: ``prompt`` (with the media's placeholders), then ``gen`` generated tokens."""
    turn = Turn(
        index=0,
        item_index=1,
        kind="message",
        segment=0,
        prompt_token_ids=prompt,
        generation_token_ids=gen,
        generation_logprobs=[0.0] * len(gen),
        media=list(media),
    )
    return Trajectory(turns=[turn], reward=reward, task_index=task, rollout_index=rollout)


def make_batch(tiny: TinyVLM, *, groups: int = 2, group_size: int = 4, dedup: bool = True) -> TrainBatch:
    """``groups`` prompts (one image each) x ``group_size`` completions; rewards alternate 1, 0."""
    trajs = []
    for g in range(groups):
        img = image((40 * g + 20, 90, 200 - 30 * g))
        for r in range(group_size):
            gen = [60 + (r % 2), 70 + g, 80 + r, tiny.eos_token_id]
            trajs.append(trajectory(tiny, img, gen, reward=float(r % 2 == 0), task=g, rollout=r))
    return TrainBatch.from_trajectories(
        trajs, MediaProcessor(tiny.processor), group_size=group_size, dedup=dedup
    )


def with_current_logprobs(model: torch.nn.Module, batch: TrainBatch) -> TrainBatch:
    """``batch`` whose generation logprobs are the model's own (ratio 1 at the first step)."""
    from gymbridge.trainer import token_logprobs

    with torch.no_grad():
        lp = token_logprobs(model, batch)
    return replace(batch, logprobs=lp * batch.loss_mask)


_BOUNDS = {"image": ("<|vision_start|>", "<|vision_end|>"), "video": ("<|vision_start|>", "<|vision_end|>")}
_BOUNDS["audio"] = ("<|audio_start|>", "<|audio_end|>")
_PADS = {"image": "<|image_pad|>", "video": "<|video_pad|>", "audio": "<|audio_pad|>"}


def media_batch(
    tokenizer: Any,
    processor: Any,
    rows: Sequence[tuple[Sequence[MediaItem], int]],
    *,
    group_size: int = 2,
) -> TrainBatch:
    """One trajectory per ``(media, n_generated)``: text, each medium between its boundary tokens with
    as many placeholders as the processor gives it, text, then ``n_generated`` generated tokens.
    Rewards alternate 1, 0 (nonzero advantages in every group)."""
    proc = MediaProcessor(processor)
    items = [m for media, _ in rows for m in media]
    processed = proc.process(items) if items else {}

    def tid(token: str) -> int:
        return int(tokenizer.convert_tokens_to_ids(token))

    trajs = []
    for r, (media, n_gen) in enumerate(rows):
        prompt = [tid("<|im_start|>"), 40 + r % 5, 41, 42]
        for m in media:
            start, end = _BOUNDS[m.modality]
            count = processed[m.key].num_placeholders
            assert count is not None
            prompt += [tid(start), *([tid(_PADS[m.modality])] * count), tid(end), 43]
        prompt += [44, 45]
        gen = [60 + (r + i) % 30 for i in range(n_gen - 1)] + [tid("<|im_end|>")]
        trajs.append(one_turn(prompt, gen, media, reward=float(r % 2 == 0), task=r // group_size, rollout=r))
    return TrainBatch.from_trajectories(trajs, proc, group_size=group_size)
