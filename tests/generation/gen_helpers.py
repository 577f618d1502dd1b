"""Helpers shared by the generation and rollout tests: media, an independent teacher-forced reference."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image

from gymbridge.generation.types import SamplingConfig
from gymbridge.media import encode_data_url
from gymbridge.trajectory.types import Trajectory


def png_data_url(color: tuple[int, int, int] = (255, 0, 0), size: tuple[int, int] = (64, 48)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return encode_data_url(buf.getvalue(), "image/png")


def media_token_ids(tiny: Any) -> list[int]:
    """The tiny model's media placeholder and vision boundary ids (never sampled by the generator)."""
    return [tiny.image_token_id, tiny.video_token_id, tiny.vision_start_token_id, tiny.vision_end_token_id]


def reference_logprobs(
    tiny: Any,
    token_ids: Sequence[int],
    images: Sequence[Any],
    sampling: SamplingConfig,
    *,
    mask_media_tokens: bool = True,
) -> list[float]:
    """Teacher-forced ``[L]`` log-probabilities of ``token_ids[1:]`` (0.0 at position 0).

    Independent of ``HFGenerator``: one plain forward pass of the tiny model over the
    whole sequence with all its images, then (by hand) the media-token mask the generator
    samples under (``mask_media_tokens``), temperature and top-p.
    """
    ids = torch.tensor([list(token_ids)], dtype=torch.long)
    kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if images:
        feats = tiny.processor.image_processor(images=list(images), return_tensors="pt")
        kwargs["pixel_values"] = feats["pixel_values"]
        kwargs["image_grid_thw"] = feats["image_grid_thw"]
        kwargs["mm_token_type_ids"] = (ids == tiny.image_token_id).to(torch.int32)
    with torch.no_grad():
        logits = tiny.model(**kwargs).logits[0].double()
    if mask_media_tokens:
        logits[:, media_token_ids(tiny)] = float("-inf")
    if sampling.temperature > 0:
        logits = logits / sampling.temperature
        if sampling.top_p < 1.0:
            probs = torch.softmax(logits, dim=-1)
            sorted_p, order = torch.sort(probs, dim=-1, descending=False)
            cum = torch.cumsum(sorted_p, dim=-1)
            drop_sorted = cum <= (1 - sampling.top_p)
            drop_sorted[..., -1] = False
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
    lp = torch.log_softmax(logits, dim=-1)
    out = [0.0]
    for pos in range(1, len(token_ids)):
        out.append(float(lp[pos - 1, token_ids[pos]]))
    return out


def max_logprob_diff(tiny: Any, traj: Trajectory, sampling: SamplingConfig, segment: int = 0) -> float:
    """Max |generator logprob - teacher-forced logprob| over a segment's generated tokens."""
    tokens = traj.token_ids(segment)
    images = [m.image() for m in traj.media(segment) if m.modality == "image"]
    ref = reference_logprobs(tiny, tokens, images, sampling)
    got = traj.logprobs(segment)
    mask = traj.loss_mask(segment)
    diffs = [abs(g - r) for g, r, m in zip(got, ref, mask, strict=True) if m]
    assert diffs, "the segment has no generated tokens"
    return max(diffs)
