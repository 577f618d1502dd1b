"""zoom_read task data: a large canvas with small numbers, the renderer, the crop, the reward.

The model sees only a downscaled preview of a ``canvas_size`` square canvas, where the
small numbers are unreadable. One number sits in a red box; the model zooms (``zoom``
with a bbox in canvas pixels returns a full-resolution crop) until it can read it, then
calls ``answer``. The scene description (every text item and shape, with positions) rides
at the row's top level, so the server re-renders the exact canvas without any RNG.

Invariants: text items never overlap each other; exactly one item is boxed (the target);
``render(scene)`` is a pure function of the scene; a crop is clamped to the canvas and
scaled so its longer side is ``zoom_size`` pixels.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Annotated, Any

from PIL import Image, ImageDraw, ImageFont
from pydantic import Field

from gymbridge.server import image_part
from gymbridge_envs._common import png_data_url, row_rng

ENV_NAME = "zoom_read"
TARGET_COLOR = (220, 30, 30)

SYSTEM_PROMPT = (
    "You are a visual assistant. You see a small preview of a much larger canvas. Somewhere on the canvas "
    "a number is written inside a red box, too small to read in the preview. Call zoom with bbox "
    "[x0, y0, x1, y1] in canvas pixel coordinates to see that region at full resolution; zoom as often "
    "as you need. When you can read the number in the red box, call answer with its digits."
)


MAX_TURNS = 3
"""Model calls an episode may take (a run's ``rollout.max_turns`` when it sets none)."""
SMOKE_PARAMS: dict[str, Any] = {"canvas_size": 256, "thumb_size": 56, "zoom_size": 56}
"""Generator parameters of ``gymbridge smoke run --env zoom_read`` (small, for the tiny model)."""


def tools() -> list[dict[str, Any]]:
    """The function tools the server publishes: one source of truth, the server's typed tools."""
    from gymbridge_envs.zoom_read.server import ZoomReadServer

    return ZoomReadServer.function_tools()


@functools.lru_cache(maxsize=16)
def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def _text_box(text: str, x: int, y: int, size: int) -> tuple[int, int, int, int]:
    left, top, right, bottom = _font(size).getbbox(text)
    return x + int(left), y + int(top), x + int(right), y + int(bottom)


def _overlaps(a: Sequence[int], b: Sequence[int], pad: int) -> bool:
    return not (a[2] + pad <= b[0] or b[2] + pad <= a[0] or a[3] + pad <= b[1] or b[3] + pad <= a[1])


def make_scene(
    rng: random.Random,
    *,
    canvas_size: int = 1024,
    num_digits: int = 4,
    num_distractors: int = 8,
    num_shapes: int = 12,
    font_size: int = 11,
) -> dict[str, Any]:
    """A scene description: shapes, distractor numbers and one boxed target number."""
    shapes = []
    for _ in range(num_shapes):
        w, h = rng.randint(20, 120), rng.randint(20, 120)
        x0, y0 = rng.randint(0, canvas_size - w), rng.randint(0, canvas_size - h)
        shade = rng.randint(200, 240)
        shapes.append(
            {
                "kind": rng.choice(["rect", "ellipse"]),
                "bbox": [x0, y0, x0 + w, y0 + h],
                "color": [shade, shade, rng.randint(200, 250)],
            }
        )
    items: list[dict[str, Any]] = []
    boxes: list[tuple[int, int, int, int]] = []
    margin = 24
    for k in range(num_distractors + 1):
        is_target = k == 0
        text = str(rng.randint(10 ** (num_digits - 1), 10**num_digits - 1))
        for _attempt in range(1000):
            x = rng.randint(margin, canvas_size - 6 * font_size * num_digits // 5 - margin)
            y = rng.randint(margin, canvas_size - 2 * font_size - margin)
            box = _text_box(text, x, y, font_size)
            if not any(_overlaps(box, other, pad=2 * font_size) for other in boxes):
                break
        else:
            raise ValueError("canvas too crowded; lower num_distractors or raise canvas_size")
        boxes.append(box)
        color = list(TARGET_COLOR) if is_target else [rng.randint(40, 110)] * 3
        items.append({"text": text, "x": x, "y": y, "font_size": font_size, "color": color, "box": is_target})
    return {"canvas_size": canvas_size, "shapes": shapes, "items": items}


def target_of(scene: Mapping[str, Any]) -> dict[str, Any]:
    return next(dict(item) for item in scene["items"] if item.get("box"))


def target_bbox(scene: Mapping[str, Any], pad: int = 4) -> list[int]:
    """The red box around the target number, in canvas pixels."""
    t = target_of(scene)
    x0, y0, x1, y1 = _text_box(str(t["text"]), int(t["x"]), int(t["y"]), int(t["font_size"]))
    return [x0 - pad, y0 - pad, x1 + pad, y1 + pad]


def render(scene: Mapping[str, Any]) -> Image.Image:
    """The full-resolution canvas (pure function of ``scene``)."""
    size = int(scene["canvas_size"])
    img = Image.new("RGB", (size, size), (250, 250, 247))
    draw = ImageDraw.Draw(img)
    for shape in scene["shapes"]:
        box = [int(v) for v in shape["bbox"]]
        fill = tuple(int(v) for v in shape["color"])
        if shape["kind"] == "ellipse":
            draw.ellipse(box, fill=fill)
        else:
            draw.rectangle(box, fill=fill)
    for item in scene["items"]:
        color = tuple(int(v) for v in item["color"])
        if item.get("box"):
            draw.rectangle(target_bbox(scene), outline=TARGET_COLOR, width=2)
        draw.text(
            (int(item["x"]), int(item["y"])),
            str(item["text"]),
            fill=color,
            font=_font(int(item["font_size"])),
        )
    return img


def preview(canvas: Image.Image, thumb_size: int) -> Image.Image:
    return canvas.resize((thumb_size, thumb_size), Image.Resampling.BILINEAR)


def clamp_bbox(bbox: Sequence[int], canvas_size: int) -> tuple[int, int, int, int]:
    """``bbox`` clamped to the canvas; raises ``ValueError`` when it is not a non-empty box."""
    if len(bbox) != 4:
        raise ValueError(f"bbox must have 4 integers [x0, y0, x1, y1], got {len(bbox)}")
    x0, y0, x1, y1 = (int(v) for v in bbox)
    if x1 <= x0 or y1 <= y0:
        raise ValueError(f"bbox {list(bbox)} is empty: need x1 > x0 and y1 > y0")
    cx0, cy0 = max(0, x0), max(0, y0)
    cx1, cy1 = min(canvas_size, x1), min(canvas_size, y1)
    if cx1 <= cx0 or cy1 <= cy0:
        raise ValueError(f"bbox {list(bbox)} lies outside the {canvas_size}x{canvas_size} canvas")
    return cx0, cy0, cx1, cy1


def crop(canvas: Image.Image, bbox: Sequence[int], zoom_size: int) -> Image.Image:
    """The region ``bbox`` (clamped) scaled so that its longer side is ``zoom_size`` px."""
    x0, y0, x1, y1 = clamp_bbox(bbox, canvas.width)
    region = canvas.crop((x0, y0, x1, y1))
    scale = zoom_size / max(region.width, region.height)
    size = (max(1, round(region.width * scale)), max(1, round(region.height * scale)))
    return region.resize(size, Image.Resampling.BICUBIC)


def make_row(
    seed: int,
    index: int,
    *,
    canvas_size: Annotated[int, Field(ge=64, le=8192)] = 1024,
    thumb_size: Annotated[int, Field(ge=16, le=4096)] = 256,
    zoom_size: Annotated[int, Field(ge=16, le=4096)] = 256,
    num_digits: Annotated[int, Field(ge=1, le=12)] = 4,
    num_distractors: Annotated[int, Field(ge=0)] = 8,
    font_size: Annotated[int, Field(ge=4, le=256)] = 11,
) -> dict[str, Any]:
    """Row ``index`` of the dataset generated with ``seed``."""
    rng = row_rng(ENV_NAME, seed, index)
    scene = make_scene(
        rng,
        canvas_size=canvas_size,
        num_digits=num_digits,
        num_distractors=num_distractors,
        font_size=font_size,
    )
    user_text = (
        f"This is a {thumb_size}x{thumb_size} preview of a {canvas_size}x{canvas_size} canvas. "
        f"Read the {num_digits}-digit number inside the red box."
    )
    return {
        "responses_create_params": {
            "input": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {
                    "role": "user",
                    "content": [
                        image_part(png_data_url(preview(render(scene), thumb_size))),
                        {"type": "input_text", "text": user_text},
                    ],
                },
            ],
            "tools": tools(),
        },
        "scene": scene,
        "zoom_size": zoom_size,
        "target_value": target_of(scene)["text"],
    }


def generate(n: int, seed: int = 0, **params: Any) -> Iterator[dict[str, Any]]:
    for index in range(n):
        yield make_row(seed, index, **params)


def normalize_answer(value: object) -> str | None:
    """The digits of an answer (``" 4,821 "`` -> ``"4821"``); ``None`` when there are none."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    digits = "".join(ch for ch in str(value) if ch.isdigit())
    return digits or None


def answer_reward(target_value: str, answered: object) -> float:
    """1.0 when the answered digits equal the target's, else 0.0."""
    got = normalize_answer(answered)
    return 1.0 if got is not None and got == normalize_answer(target_value) else 0.0


def zoom_call_text(bbox: Sequence[int]) -> str:
    """The Hermes-style text of one ``zoom`` call (what the tiny model's chat template renders)."""
    args = ", ".join(str(int(v)) for v in bbox)
    return f'<tool_call>\n{{"name": "zoom", "arguments": {{"bbox": [{args}]}}}}\n</tool_call>'


def format_examples(row: Mapping[str, Any], rng: random.Random) -> list[tuple[list[dict[str, Any]], str]]:
    """Image-independent warm-up targets for ``row``: the ``zoom`` call's format only.

    The target of the first model call is a zoom of the whole canvas, ``[0, 0, S, S]`` for a
    canvas of side ``S``: the same for every row of a canvas size, whatever the preview shows,
    so the warm-up teaches the call's format (the model then zooms, and the crop reaches the
    next model call as a tool image) and never where the red box is or what it says.
    ``rng`` is unused (one target per row).
    """
    del rng
    side = int(row["scene"]["canvas_size"])
    return [(list(row["responses_create_params"]["input"]), zoom_call_text([0, 0, side, side]))]
