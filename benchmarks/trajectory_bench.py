"""Postprocessing speed: Gym result JSON -> Trajectory, split into JSON parsing and the walk.

Builds ``--results`` synthetic ``/run`` results in NeMo Gym's shapes, each with
``--turns`` model calls; every call is a ``function_call`` whose tool answers with
one PNG screenshot (a data URL in ``function_call_output.output``), so every turn
owns one image. Token fields are training-mode shaped: each item's
``prompt_token_ids`` is the *full* prompt (the history grows every turn), as a
real model server returns it.

It then times, in one run (these machines are noisy; compare the ratio):

* ``parse``: ``orjson.loads`` of each result;
* ``walk``:  ``from_gym_result`` on that parsed dict (token checks, media index,
  lazy ``MediaItem.from_ref`` per image; nothing fetched or decoded);
* ``end-to-end``: ``from_gym_result`` on the JSON bytes (parse + walk in one call).

and prints results/s and ``walk / parse`` (the walk must not be the bottleneck).

    .venv/bin/python benchmarks/trajectory_bench.py            # 1,000 results x 8 turns
    .venv/bin/python benchmarks/trajectory_bench.py --results 200 --repeat 1
"""

from __future__ import annotations

import argparse
import base64
import io
import random
import time
from typing import Any

import orjson
from PIL import Image

from gymbridge.trajectory import from_gym_result


def _png(px: int, seed: int) -> str:
    rng = random.Random(seed)
    img = Image.frombytes("RGB", (px, px), bytes(rng.getrandbits(8) for _ in range(px * px * 3)))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def build_result(
    index: int,
    *,
    turns: int,
    images: list[str],
    prompt_tokens: int,
    obs_tokens: int,
    gen_tokens: int,
) -> bytes:
    rng = random.Random(index)
    seen: list[int] = []
    pending = [rng.randrange(150_000) for _ in range(prompt_tokens)]
    output: list[dict[str, Any]] = []
    for turn in range(turns):
        prompt = seen + pending
        generation = [rng.randrange(150_000) for _ in range(gen_tokens)]
        call_id = f"call_{index}_{turn}"
        output.append(
            {
                "arguments": '{"x": 12, "y": 34}',
                "call_id": call_id,
                "name": "click",
                "type": "function_call",
                "id": call_id,
                "status": "completed",
                "prompt_token_ids": prompt,
                "generation_token_ids": generation,
                "generation_log_probs": [-rng.random() for _ in range(gen_tokens)],
            }
        )
        output.append(
            {
                "call_id": call_id,
                "output": images[(index + turn) % len(images)],
                "type": "function_call_output",
                "id": None,
                "status": None,
            }
        )
        seen = prompt + generation
        pending = [rng.randrange(150_000) for _ in range(obs_tokens)]
    result = {
        "responses_create_params": {
            "input": [
                {"role": "system", "content": "Click on the requested circle.", "type": "message"},
                {
                    "role": "user",
                    "type": "message",
                    "content": [
                        {"type": "input_image", "image_url": images[index % len(images)], "detail": "auto"},
                        {"type": "input_text", "text": "Click on the red circle."},
                    ],
                },
            ],
            "tools": [],
        },
        "response": {"id": f"resp_{index}", "object": "response", "output": output, "status": "completed"},
        "reward": 1.0,
        "_ng_task_index": index,
        "_ng_rollout_index": 0,
    }
    return orjson.dumps(result)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--results", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--image-px", type=int, default=64, help="side of each (noise) PNG screenshot")
    parser.add_argument("--prompt-tokens", type=int, default=400, help="initial prompt length")
    parser.add_argument("--obs-tokens", type=int, default=200, help="tokens added per observation")
    parser.add_argument("--gen-tokens", type=int, default=50, help="generated tokens per turn")
    parser.add_argument("--repeat", type=int, default=3, help="timed passes; the best is reported")
    args = parser.parse_args()

    images = [_png(args.image_px, seed) for seed in range(16)]
    blobs = [
        build_result(
            i,
            turns=args.turns,
            images=images,
            prompt_tokens=args.prompt_tokens,
            obs_tokens=args.obs_tokens,
            gen_tokens=args.gen_tokens,
        )
        for i in range(args.results)
    ]
    total_mb = sum(len(b) for b in blobs) / 1e6

    # Results arrive one at a time in a real run: parse, walk, drop. Timing each stage per
    # result inside that loop keeps the heap small, as it is in production (holding all
    # 1,000 parsed results alive instead makes the garbage collector dominate both stages).
    best_parse = best_walk = best_e2e = float("inf")
    trajectories = []
    for _ in range(args.repeat):
        parse_s = walk_s = 0.0
        trajectories = []
        for blob in blobs:
            t0 = time.perf_counter()
            parsed = orjson.loads(blob)
            t1 = time.perf_counter()
            trajectories.append(from_gym_result(parsed))
            t2 = time.perf_counter()
            parse_s += t1 - t0
            walk_s += t2 - t1
        t3 = time.perf_counter()
        for blob in blobs:
            from_gym_result(blob)
        e2e_s = time.perf_counter() - t3
        best_parse, best_walk, best_e2e = (
            min(best_parse, parse_s),
            min(best_walk, walk_s),
            min(best_e2e, e2e_s),
        )

    n_turns = sum(len(t.turns) for t in trajectories)
    n_media = sum(len(turn.media) for t in trajectories for turn in t.turns)
    assert n_turns == args.results * args.turns, "every call must be a turn"
    assert n_media == args.results * args.turns, "one image per turn"

    n = args.results
    print(
        f"{n} results x {args.turns} turns, one {args.image_px}px PNG per turn, "
        f"{total_mb:.1f} MB of JSON ({total_mb / n * 1e3:.0f} kB/result), best of {args.repeat}"
    )
    print(f"{'stage':<28}{'seconds':>10}{'results/s':>12}{'ms/result':>12}")
    for name, seconds in (
        ("parse (orjson.loads)", best_parse),
        ("walk (from_gym_result)", best_walk),
        ("end-to-end (bytes in)", best_e2e),
    ):
        print(f"{name:<28}{seconds:>10.3f}{n / seconds:>12.0f}{seconds / n * 1e3:>12.3f}")
    print(f"walk / parse = {best_walk / best_parse:.2f}")


if __name__ == "__main__":
    main()
