"""side_pick task data: a dark bar along one side of a white image, a one-letter answer, the reward.

A row shows one dark bar lying along one side of a white square image (full length, its
thickness drawn per row) and asks which side; the answer is that side's letter
(:data:`SIDES`: ``T`` top, ``B`` bottom, ``L`` left, ``R`` right), one token of the tiny
model's vocabulary. Unlike color_pick, every image of a given thickness holds the same colours in
the same amounts: only *where* the bar lies tells the answer. ``blank=True`` draws no bar while
the answer stays the row's side: the control under which nothing is learnable (reward stays at
chance, 1/4).

What the tiny Qwen2-VL can see decides the layout (docs/benchmarks.md, "The spatial task (issue 24)"): its
vision tower cuts the image into 14-pixel patches and merges each 2x2 block (28x28 pixels) into
one image token, the four patches in a fixed order; its language model's M-RoPE turns by at most
0.1 rad between neighbouring image tokens, so the image tokens reach it almost as an unordered
set, and what it reads is each token's content. A bar 14-20 pixels thick lies inside the row (or
column) of tokens along its side and darkens their outer patches, so the side is written into
those tokens' content. A shape anywhere inside a quadrant is not: its quadrant is the *position*
of the tokens that differ. The default 168x168 pixels gives 36 image tokens, 6 along each side
(docs/benchmarks.md compares image sizes).

:func:`format_examples` gives the run's format warm-up (``gymbridge/run/warmup.py``) its targets:
a letter drawn at random, never the row's, so after the warm-up every letter is as likely under
every image.

Invariants: the image of a row is a pure function of ``(side, thickness, img_size, blank)``; the
side of row ``i`` depends only on ``(seed, i)`` and each block of 4 rows (from row 0) holds every
side once (:func:`side_of`); the verifier reads the first word of the assistant's text
(case-insensitive, punctuation stripped).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from typing import Annotated, Any

from PIL import Image, ImageDraw
from pydantic import Field

from gymbridge.server import image_part
from gymbridge_envs._common import first_word, png_data_url, row_rng

ENV_NAME = "side_pick"

SIDES: dict[str, str] = {"T": "top", "B": "bottom", "L": "left", "R": "right"}
"""Answer letter -> side; each letter is one token of the tiny tokenizer."""
BACKGROUND_RGB = (255, 255, 255)
BAR_RGB = (30, 30, 30)
QUESTION = "Where is the bar? Answer T, B, L or R."

MAX_TURNS = 1
"""One model call: the image is in the prompt."""
SMOKE_PARAMS: dict[str, Any] = {}
"""Generator parameters of ``gymbridge smoke run --env side_pick``: its defaults (168x168) are the smoke's."""


def side_of(seed: int, index: int) -> str:
    """Row ``index``'s answer letter: rows come in blocks of 4, each block a shuffle of the sides.

    So every 4 consecutive rows from a block start hold each side once, and a policy that
    ignores the image scores exactly chance on them.
    """
    block = list(SIDES)
    row_rng(ENV_NAME, seed, index // len(block)).shuffle(block)
    return block[index % len(block)]


def bar_box(side: str, thickness: int, img_size: int) -> tuple[int, int, int, int]:
    """The bar's pixel box ``(x0, y0, x1, y1)``, inclusive, along ``side``."""
    last = img_size - 1
    return {
        "T": (0, 0, last, thickness - 1),
        "B": (0, img_size - thickness, last, last),
        "L": (0, 0, thickness - 1, last),
        "R": (img_size - thickness, 0, last, last),
    }[side]


def render(side: str, thickness: int, img_size: int, *, blank: bool = False) -> Image.Image:
    """The row's image: a white square of ``img_size`` pixels with the bar (none when ``blank``)."""
    img = Image.new("RGB", (img_size, img_size), BACKGROUND_RGB)
    if not blank:
        ImageDraw.Draw(img).rectangle(bar_box(side, thickness, img_size), fill=BAR_RGB)
    return img


def make_row(
    seed: int,
    index: int,
    *,
    img_size: Annotated[int, Field(ge=56, le=448)] = 168,
    blank: bool = False,
) -> dict[str, Any]:
    """Row ``index`` of the dataset generated with ``seed``; the bar is 14-20 pixels thick."""
    side = side_of(seed, index)
    rng = row_rng(ENV_NAME, seed, index)
    thickness = rng.randint(min(14, img_size // 4), min(20, img_size // 3))
    image = image_part(png_data_url(render(side, thickness, img_size, blank=blank)))
    return {
        "responses_create_params": {
            "input": [{"role": "user", "content": [image, {"type": "input_text", "text": QUESTION}]}]
        },
        "side": side,
        "thickness": thickness,
        "img_size": img_size,
        "blank": blank,
    }


def generate(n: int, seed: int = 0, **params: Any) -> Iterator[dict[str, Any]]:
    """``n`` rows; row ``i`` depends only on ``(seed, i, params)``."""
    for index in range(n):
        yield make_row(seed, index, **params)


def answer_of(text: str) -> str | None:
    """The first word of ``text``, upper-case (``None`` when there is none)."""
    word = first_word(text)
    return word.upper() if word else None


def side_reward(side: str, text: str) -> float:
    return 1.0 if answer_of(text) == side else 0.0


def format_examples(row: Mapping[str, Any], rng: random.Random) -> list[tuple[list[dict[str, Any]], str]]:
    """Image-independent warm-up targets for ``row``: ``[(Responses input items, target text)]``.

    The target is ``rng.choice`` of the four letters, drawn without looking at the row's side:
    the warm-up teaches the format (one letter, then end of turn), never where the bar is.
    """
    return [(list(row["responses_create_params"]["input"]), rng.choice(list(SIDES)))]
