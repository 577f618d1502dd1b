"""Builders shared by the tensor tests: images, trajectories with matching placeholders."""

from __future__ import annotations

import io

from PIL import Image

from gymbridge.media import MediaItem
from gymbridge.models.tiny_vlm import TinyVLM
from gymbridge.trajectory.types import Trajectory, Turn

TEXT = [40, 41, 42, 43]  # ordinary (non-special) token ids of the tiny tokenizer


def png_bytes(color: tuple[int, int, int], size: tuple[int, int] = (56, 56)) -> bytes:
    buf = io.BytesIO()
    img = Image.new("RGB", size, color)
    img.putpixel((0, 0), (color[0] ^ 255, 7, 9))  # not a flat image: patches differ
    img.save(buf, format="PNG")
    return buf.getvalue()


def image(color: tuple[int, int, int], size: tuple[int, int] = (56, 56)) -> MediaItem:
    return MediaItem.from_bytes(png_bytes(color, size), "image", mime="image/png")


def tokens_per_image(size: tuple[int, int]) -> int:
    """Merged placeholder tokens the tiny processor gives an image of ``size`` (w, h)."""
    w, h = size
    return (h // 28) * (w // 28)  # sizes used in tests are multiples of 28 within the pixel bounds


def prompt(tiny: TinyVLM, n_tokens_per_image: list[int], text: list[int] | None = None) -> list[int]:
    out = [tiny.im_start_token_id, *(text or TEXT)]
    for n in n_tokens_per_image:
        out += [tiny.vision_start_token_id, *([tiny.image_token_id] * n), tiny.vision_end_token_id]
    return out


def turn(
    tiny: TinyVLM,
    index: int,
    media: list[MediaItem],
    *,
    gen: list[int] | None = None,
    segment: int = 0,
    placeholders: list[int] | None = None,
) -> Turn:
    counts = placeholders if placeholders is not None else [tokens_per_image((56, 56))] * len(media)
    g = gen or [50 + index, 51 + index, tiny.eos_token_id]
    return Turn(
        index=index,
        item_index=2 * index,
        kind="message",
        segment=segment,
        prompt_token_ids=prompt(tiny, counts),
        generation_token_ids=g,
        generation_logprobs=[-0.5 - 0.1 * i for i in range(len(g))],
        media=list(media),
    )


def traj(turns: list[Turn], reward: float, **kw: object) -> Trajectory:
    return Trajectory(turns=turns, reward=reward, **kw)  # type: ignore[arg-type]


def mixed_batch(tiny: TinyVLM, group_size: int = 4) -> list[Trajectory]:
    """The batch from issue 4: an image-first group, a text-first group whose tool returns
    images in two turns, and a text-only group (``group_size`` samples each)."""
    shared = png_bytes((200, 10, 10))
    out: list[Trajectory] = []
    for i in range(group_size):  # image-first: every sample loads the prompt image separately
        first = MediaItem.from_bytes(shared, "image")
        out.append(traj([turn(tiny, 0, [first]), turn(tiny, 1, [])], reward=float(i)))
    for i in range(group_size):  # text-first: tool images at turns 1 and 2 (one shared, one unique)
        common = image((10, 200, 10))
        unique = image((10, 10, 20 + i))
        turns = [turn(tiny, 0, []), turn(tiny, 1, [common]), turn(tiny, 2, [unique])]
        out.append(traj(turns, reward=float(i % 2)))
    for i in range(group_size):  # text only
        out.append(traj([turn(tiny, 0, [])], reward=0.5 * i))
    return out
