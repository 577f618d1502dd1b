"""color_pick task data: a solid-colour image, a one-word answer, the reward, the format warm-up.

A row shows one solid colour (one of ``colors``) and asks which it is; the answer is the
colour's name, one token of the tiny model's vocabulary (the tiny tokenizer's corpus holds
each colour name alone for that). With ``reveal="tool"`` the prompt
holds no image: the model must call ``look`` (no arguments) and the colour arrives as the
tool's image at the second model call, so it can only be learned through per-turn media.
``blank=True`` paints every prompt image mid-grey while the answer stays the row's colour:
the control under which nothing is learnable (reward stays at chance, ``1 / len(colors)``).

:func:`format_examples` gives the launcher's format warm-up its supervised targets. They
teach the answer *format* only: the targets are drawn from the answer vocabulary with a
random generator that never sees the row's colour, so after the warm-up every answer is
as likely under every image (chance) and the image-to-answer mapping is left to the
environment's reward.

Invariants: the image of a row is a pure function of ``(color, img_size, blank)``; the
verifier reads the first word of the assistant's text (case-insensitive, punctuation
stripped); the colour of row ``i`` depends only on ``(seed, i, colors)`` and each block of
``len(colors)`` rows (from row 0) holds every colour once (:func:`color_of`).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from PIL import Image

from gymbridge.server import image_part
from gymbridge_envs._common import first_word, png_data_url, row_rng

ENV_NAME = "color_pick"

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "blue": (40, 80, 220),
    "green": (40, 170, 60),
    "yellow": (230, 200, 40),
}
BLANK_RGB = (128, 128, 128)
LOOK_CALL = '<tool_call>\n{"name": "look", "arguments": {}}\n</tool_call>'
"""The Hermes-style text of the one ``look`` call (what the tiny model's chat template renders)."""

MAX_TURNS = 1
"""Model calls an episode takes with ``reveal: prompt`` (``reveal: tool`` takes 2: smoke_color_tool.yaml)."""
SMOKE_PARAMS: dict[str, Any] = {}
"""Generator parameters of ``gymbridge smoke run --env color_pick``: its defaults are already small."""


def tools() -> list[dict[str, Any]]:
    """The function tools the server publishes (``look``): the server's typed tools."""
    from gymbridge_envs.color_pick.server import ColorPickServer

    return ColorPickServer.function_tools()


def parse_colors(colors: str) -> list[str]:
    names = [c.strip() for c in colors.split(",") if c.strip()]
    unknown = [c for c in names if c not in COLORS]
    if unknown or len(names) < 2 or len(set(names)) != len(names):
        raise ValueError(
            f"colors must be 2+ distinct names of {sorted(COLORS)}, comma-separated; got {colors!r}"
        )
    return names


def color_of(seed: int, index: int, names: list[str]) -> str:
    """Row ``index``'s colour: rows come in blocks of ``len(names)``, each block a shuffle of ``names``.

    So every ``len(names)`` consecutive rows from a block start hold each colour once, and a
    policy that ignores the image scores exactly chance on them (no lucky first step).
    """
    block = list(names)
    row_rng(ENV_NAME, seed, index // len(names)).shuffle(block)
    return block[index % len(names)]


def render(color: str, img_size: int, *, blank: bool = False) -> Image.Image:
    return Image.new("RGB", (img_size, img_size), BLANK_RGB if blank else COLORS[color])


def question(names: list[str]) -> str:
    return f"What colour is the image? Answer with one word: {' or '.join(names)}."


def make_row(
    seed: int,
    index: int,
    *,
    colors: str = "red,blue",
    img_size: int = 56,
    reveal: Literal["prompt", "tool"] = "prompt",
    blank: bool = False,
) -> dict[str, Any]:
    """Row ``index`` of the dataset generated with ``seed``."""
    names = parse_colors(colors)
    if reveal not in ("prompt", "tool"):
        raise ValueError(f"reveal must be 'prompt' or 'tool', got {reveal!r}")
    if not 28 <= img_size <= 448:
        raise ValueError(f"img_size must be in [28, 448], got {img_size}")
    color = color_of(seed, index, names)
    rcp: dict[str, Any]
    if reveal == "prompt":
        content = [image_part(png_data_url(render(color, img_size, blank=blank))), question(names)]
        rcp = {
            "input": [
                {
                    "role": "user",
                    "content": [content[0], {"type": "input_text", "text": content[1]}],
                },
            ]
        }
    else:
        text = "Call look to see the image. " + question(names)
        rcp = {
            "input": [{"role": "user", "content": text}],
            "tools": tools(),
        }
    return {
        "responses_create_params": rcp,
        "color": color,
        "colors": names,
        "img_size": img_size,
        "reveal": reveal,
        "blank": blank,
    }


def generate(n: int, seed: int = 0, **params: Any) -> Iterator[dict[str, Any]]:
    """``n`` rows; row ``i`` depends only on ``(seed, i, params)``."""
    for index in range(n):
        yield make_row(seed, index, **params)


def answer_of(text: str) -> str | None:
    """The first word of ``text``, lower-case (``None`` when there is none)."""
    return first_word(text)


def pick_reward(color: str, text: str) -> float:
    return 1.0 if answer_of(text) == color else 0.0


def format_examples(row: Mapping[str, Any], rng: random.Random) -> list[tuple[list[dict[str, Any]], str]]:
    """Image-independent warm-up targets for ``row``: ``[(Responses input items, target text), ...]``.

    Every answer target is ``rng.choice(row["colors"])``: drawn without looking at the row's
    colour, so the warm-up teaches the format (one colour word, then end of turn; in tool
    mode, first the ``look`` call) and never which colour an image shows.

    Drawn at random, not balanced: with every row given every answer word once, the warm-up's
    loss reached its floor (0.347, ln 2 / 2 per token) and the multi-turn smoke (seed 0, one
    torch thread) then stayed at chance for 80 steps with grad_norm at most 0.13 (our reading:
    the answer no longer depended on the image at all); with random targets it learned (0.994).
    """
    rcp = row["responses_create_params"]
    items = list(rcp["input"])
    names = list(row["colors"])
    if row.get("reveal", "prompt") == "prompt":
        return [(items, rng.choice(names))]
    # tool mode: turn 0 calls look; turn 1 sees a look result (an image of a colour drawn at random,
    # independent of the target too) and answers a colour drawn at random
    shown = rng.choice(names)
    call_id = f"warmup_{rng.randrange(1 << 30)}"
    after = [
        *items,
        {"type": "function_call", "name": "look", "arguments": "{}", "call_id": call_id},
        {
            "type": "function_call_output",
            "call_id": call_id,
            "output": [
                {"type": "input_text", "text": "The image:"},
                image_part(png_data_url(render(shown, int(row["img_size"])))),
            ],
        },
    ]
    return [(items, LOOK_CALL), (after, rng.choice(names))]
