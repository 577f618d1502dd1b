"""Batches for the packing tests: rows of different lengths, media in several rows, on both tiny models."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gymbridge.media import MediaItem
from gymbridge.tensors import MediaProcessor, TrainBatch
from gymbridge.trajectory.types import Trajectory, Turn

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
        trajs.append(
            Trajectory(turns=[turn], reward=float(r % 2 == 0), task_index=r // group_size, rollout_index=r)
        )
    return TrainBatch.from_trajectories(trajs, proc, group_size=group_size)
