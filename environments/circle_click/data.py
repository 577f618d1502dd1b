"""circle_click task data: seeded scenes of coloured circles, the PNG renderer, the reward.

A row asks the model to click the centre of the circle of ``target_color`` in an image;
the stock Gym row shape is kept exactly (``circles`` and ``target_color`` at the top level,
``responses_create_params`` with ``input`` + ``tools`` only), so stock circle_click data
and ours are interchangeable.

Invariants: circles of one scene never overlap (a click can hit at most one circle);
colours in a scene are distinct; the target colour is one of them; the image is exactly
``img_size`` x ``img_size`` pixels with (0, 0) at the top-left corner.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Annotated, Any

from PIL import Image, ImageDraw
from pydantic import Field

from gymbridge.server import image_part
from gymbridge_envs._common import png_data_url, row_rng

ENV_NAME = "circle_click"

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 50, 47),
    "blue": (38, 139, 210),
    "green": (133, 153, 0),
    "yellow": (181, 137, 0),
    "purple": (108, 113, 196),
    "orange": (203, 75, 22),
    "cyan": (42, 161, 152),
    "pink": (211, 54, 130),
}

SYSTEM_PROMPT = (
    "You are a visual assistant. The image has pixel coordinates starting at (0, 0) in the top-left "
    "corner. Use the click tool to click on the center of the specified colored circle. You must pass a "
    "single integer for x and a single integer for y."
)


MAX_TURNS = 2
"""Model calls an episode may take (a run's ``rollout.max_turns`` when it sets none)."""
SMOKE_PARAMS: dict[str, Any] = {"img_size": 112, "radius_min": 8, "radius_max": 12}
"""Generator parameters of ``gymbridge smoke run --env circle_click`` (small, for the tiny model)."""


def tools() -> list[dict[str, Any]]:
    """The function tools the server publishes: one source of truth, the server's typed tools."""
    from gymbridge_envs.circle_click.server import CircleClickServer

    return CircleClickServer.function_tools()


def place_circles(num: int, img_size: int, radius: int, rng: random.Random) -> list[dict[str, int]]:
    """Centres of ``num`` non-overlapping circles (gap >= 4 px) fully inside the image."""
    margin = radius + 2
    centres: list[dict[str, int]] = []
    for _ in range(num):
        for _attempt in range(1000):
            x = rng.randint(margin, img_size - margin)
            y = rng.randint(margin, img_size - margin)
            if all(math.hypot(x - c["x"], y - c["y"]) > 2 * radius + 4 for c in centres):
                centres.append({"x": x, "y": y})
                break
        else:
            raise ValueError(
                f"cannot place {num} circles of radius {radius} in {img_size}px; lower the radius"
            )
    return centres


def render(circles: Sequence[Mapping[str, Any]], img_size: int) -> Image.Image:
    """The scene as an RGB image (white background, filled circles)."""
    img = Image.new("RGB", (img_size, img_size), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    for c in circles:
        x, y, r = int(c["x"]), int(c["y"]), int(c["radius"])
        draw.ellipse([x - r, y - r, x + r, y + r], fill=COLORS[str(c["color"])])
    return img


def make_row(
    seed: int,
    index: int,
    *,
    img_size: Annotated[int, Field(ge=32, le=4096)] = 320,
    radius_min: Annotated[int, Field(ge=1)] = 18,
    radius_max: Annotated[int, Field(ge=1)] = 36,
    min_circles: Annotated[int, Field(ge=1)] = 3,
    max_circles: Annotated[int, Field(ge=1)] = 5,
) -> dict[str, Any]:
    """Row ``index`` of the dataset generated with ``seed``."""
    if not 1 <= min_circles <= max_circles <= len(COLORS):
        raise ValueError(f"need 1 <= min_circles <= max_circles <= {len(COLORS)}")
    rng = row_rng(ENV_NAME, seed, index)
    radius = rng.randint(radius_min, radius_max)
    num = rng.randint(min_circles, max_circles)
    colors = rng.sample(sorted(COLORS), num)
    target_color = rng.choice(colors)
    centres = place_circles(num, img_size, radius, rng)
    circles = [
        {"x": p["x"], "y": p["y"], "radius": radius, "color": colors[i]} for i, p in enumerate(centres)
    ]
    others = ", ".join(f"a {c} circle" for c in colors if c != target_color)
    user_text = (
        f"This is a {img_size}x{img_size} pixel image. It shows {others}, and a {target_color} circle. "
        f"Click on the {target_color} circle."
    )
    return {
        "responses_create_params": {
            "input": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {
                    "role": "user",
                    "content": [
                        image_part(png_data_url(render(circles, img_size))),
                        {"type": "input_text", "text": user_text},
                    ],
                },
            ],
            "tools": tools(),
        },
        "circles": circles,
        "target_color": target_color,
    }


def generate(n: int, seed: int = 0, **params: Any) -> Iterator[dict[str, Any]]:
    """``n`` rows; row ``i`` depends only on ``(seed, i, params)``."""
    for index in range(n):
        yield make_row(seed, index, **params)


def point_in_circle(x: float, y: float, circle: Mapping[str, Any]) -> bool:
    return math.hypot(x - float(circle["x"]), y - float(circle["y"])) <= float(circle["radius"])


def click_reward(
    circles: Sequence[Mapping[str, Any]], target_color: str, x: int | None, y: int | None
) -> float:
    """1.0 when ``(x, y)`` lies inside (or on) the target circle, else 0.0 (no click: 0.0)."""
    if x is None or y is None:
        return 0.0
    for circle in circles:
        if circle.get("color") == target_color:
            return 1.0 if point_in_circle(x, y, circle) else 0.0
    return 0.0


def parse_click(args: Mapping[str, Any] | None) -> tuple[int | None, int | None]:
    """The clicked integer coordinates, as stock circle_click reads them (``int(...)``)."""
    if args is None:
        return None, None
    try:
        x, y = args["x"], args["y"]
        if isinstance(x, bool) or isinstance(y, bool):
            return None, None
        return int(x), int(y)
    except (KeyError, TypeError, ValueError):
        return None, None
