"""Which image layouts can the tiny Qwen2-VL read at all? Supervised probes side by side (docs/benchmarks.md).

For each layout, a fresh tiny policy is trained with cross-entropy on the *true* answer letter
(labels, not rewards: an upper bound on what GRPO can learn from the same images) and scored on
held-out images: the mean probability of the right letter among the four, every 25 steps.
Layouts (56x56, the prompt of environments/side_pick):

* ``colour``: a solid colour of four (color_pick); the answer is the colour;
* ``side_bar``: a dark bar along one side (side_pick); the answer is the side;
* ``quadrant_anywhere``: a dark square or disc anywhere inside one quadrant;
* ``quadrant_corner``: a dark square in the image's corner of that quadrant (14-22 px).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/spatial_probe.py [--steps 100] [--layouts side_bar,colour]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from typing import Any

import torch
from PIL import Image, ImageDraw

from gymbridge.generation.hf import HFGenerator, suppress_logits
from gymbridge.models.tiny_vlm import build_tiny_vlm
from gymbridge.run.warmup import _example_tensors
from gymbridge.server import image_part
from gymbridge.trainer import tiny_policy
from gymbridge_envs._common import png_data_url
from gymbridge_envs.side_pick.data import QUESTION, render

SIZE = 56
COLOURS = {"T": (220, 40, 40), "B": (40, 80, 220), "L": (40, 170, 60), "R": (230, 200, 40)}


def _colour(letter: str, rng: random.Random) -> Image.Image:
    return Image.new("RGB", (SIZE, SIZE), COLOURS[letter])


def _side_bar(letter: str, rng: random.Random) -> Image.Image:
    return render(letter, rng.randint(6, 12), SIZE)


def _square(box: tuple[int, int, int, int], disc: bool = False) -> Image.Image:
    img = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    (draw.ellipse if disc else draw.rectangle)(box, fill=(30, 30, 30))
    return img


def _quadrant_anywhere(letter: str, rng: random.Random) -> Image.Image:
    half = SIZE // 2
    side = rng.randint(8, 17)
    x0 = rng.randint(2, half - 2 - side) + (half if letter in "RB" else 0)
    y0 = rng.randint(2, half - 2 - side) + (half if letter in "LB" else 0)
    return _square((x0, y0, x0 + side - 1, y0 + side - 1), disc=rng.random() < 0.5)


def _quadrant_corner(letter: str, rng: random.Random) -> Image.Image:
    s = rng.randint(14, 22)
    x0 = SIZE - s if letter in "RB" else 0  # T: top left, R: top right, L: bottom left, B: bottom right
    y0 = SIZE - s if letter in "LB" else 0
    return _square((x0, y0, x0 + s - 1, y0 + s - 1))


LAYOUTS: dict[str, Callable[[str, random.Random], Image.Image]] = {
    "colour": _colour,
    "side_bar": _side_bar,
    "quadrant_anywhere": _quadrant_anywhere,
    "quadrant_corner": _quadrant_corner,
}


def probe(layout: str, steps: int, lr: float, rows_per_step: int = 8) -> list[tuple[int, float, float]]:
    """``[(step, p(right letter) on held-out images, seconds)]`` every 25 steps."""
    torch.manual_seed(0)
    tiny = build_tiny_vlm(0)
    policy = tiny_policy(0)
    gen = HFGenerator(policy, tiny.processor)
    letters = ["T", "B", "L", "R"]
    ids = [tiny.tokenizer.encode(x)[0] for x in letters]
    draw = LAYOUTS[layout]

    def example(i: int, seed: int) -> tuple[Any, str]:
        rng = random.Random(f"{layout}/{seed}/{i}")
        letter = letters[i % 4]
        items = [
            {
                "role": "user",
                "content": [
                    image_part(png_data_url(draw(letter, rng))),
                    {"type": "input_text", "text": QUESTION},
                ],
            }
        ]
        return _example_tensors(gen, items, None, letter), letter

    held_out = [example(i, 2) for i in range(32)]
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=lr, eps=1e-5)
    out: list[tuple[int, float, float]] = []
    started = time.perf_counter()
    for step in range(1, steps + 1):
        opt.zero_grad()
        for j in range(rows_per_step):
            (kwargs, prompt_len, target), _ = example(step * rows_per_step + j, 1)
            logits = suppress_logits(policy(**kwargs).logits[0].float(), gen.suppressed_token_ids)
            loss = -torch.log_softmax(logits, -1)[prompt_len - 1, target[0]] / rows_per_step
            loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        if step % 25 == 0:
            with torch.no_grad():
                p = 0.0
                for (kwargs, prompt_len, _), letter in held_out:
                    sub = policy(**kwargs).logits[0, prompt_len - 1, ids]
                    p += float(torch.softmax(sub, -1)[letters.index(letter)])
            out.append((step, p / len(held_out), time.perf_counter() - started))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    args = parser.parse_args()
    print(f"supervised: {args.steps} steps x 8 labelled rows, AdamW lr {args.lr}; p(right letter) held out")
    print(f"| layout | {' | '.join(f'step {s}' for s in range(25, args.steps + 1, 25))} | s |")
    print(f"|---|{'---|' * (args.steps // 25)}---|")
    for layout in args.layouts.split(","):
        rows = probe(layout, args.steps, args.lr)
        print(f"| {layout} | {' | '.join(f'{p:.4f}' for _, p, _ in rows)} | {rows[-1][2]:.0f} |", flush=True)


if __name__ == "__main__":
    main()
