"""Parse speed of a ~5 MB multi-turn Gym result: json.loads vs orjson.loads vs gymbridge.protocol.

Builds a circle_click-style ``/run`` result in memory: two base64 PNG images in the
first user message, then ``--turns`` model calls (reasoning + a ``function_call``
with token fields whose prompt grows every turn), each answered by a tool output that
carries a base64 PNG (a list of parts) and, every other turn, an injected user message
with another image; a final assistant message with token fields. Images are noise,
so base64 does not compress and the size is honest.

All timings are measured in the same run (these machines are noisy); the table
reports the median of ``--repeat`` runs and the ratio against ``json.loads`` of the
same bytes. Usage::

    .venv/bin/python benchmarks/parse_bench.py [--mb 5] [--turns 10] [--repeat 15]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
from PIL import Image

from gymbridge import protocol as p


def _png_data_url(rng: np.random.Generator, side: int) -> str:
    pixels = rng.integers(0, 256, size=(side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def build_result(target_mb: float, turns: int, seed: int = 0) -> bytes:
    """A Gym ``/run`` result of about ``target_mb`` MB (JSON bytes)."""
    rng = np.random.default_rng(seed)
    n_images = 2 + turns + (turns + 1) // 2
    # noise PNG ~ 3 bytes/pixel, base64 x4/3; leave ~7% for tokens and text
    side = int(((target_mb * 0.93e6) / n_images / 4) ** 0.5)

    def image() -> dict[str, Any]:
        return {"type": "input_image", "image_url": _png_data_url(rng, side), "detail": "auto"}

    vocab = 151_000
    prompt = rng.integers(0, vocab, size=1500).tolist()
    output: list[dict[str, Any]] = []
    for turn in range(turns):
        gen = rng.integers(0, vocab, size=120).tolist()
        output.append(
            {
                "id": f"rs_{turn:04d}",
                "summary": [
                    {"type": "summary_text", "text": f"Turn {turn}: the circle looks ü-ish; click it."}
                ],
                "type": "reasoning",
                "encrypted_content": None,
            }
        )
        output.append(
            {
                "arguments": json.dumps({"x": turn * 7, "y": turn * 11}),
                "call_id": f"call_{turn}",
                "name": "click",
                "type": "function_call",
                "id": f"fc_{turn}",
                "status": "completed",
                "prompt_token_ids": list(prompt),
                "generation_token_ids": gen,
                "generation_log_probs": (-rng.exponential(0.3, size=len(gen))).tolist(),
            }
        )
        output.append(
            {
                "call_id": f"call_{turn}",
                "output": [{"type": "input_text", "text": f"clicked {turn}"}, image()],
                "type": "function_call_output",
                "id": None,
                "status": None,
            }
        )
        prompt = prompt + gen + rng.integers(0, vocab, size=300).tolist()
        if turn % 2 == 0:
            output.append({"role": "user", "content": [image(), {"type": "input_text", "text": "Again."}]})
    gen = rng.integers(0, vocab, size=60).tolist()
    output.append(
        {
            "id": "msg_final",
            "content": [{"annotations": [], "text": "Done.", "type": "output_text", "logprobs": None}],
            "role": "assistant",
            "status": "completed",
            "type": "message",
            "prompt_token_ids": prompt,
            "generation_token_ids": gen,
            "generation_log_probs": (-rng.exponential(0.3, size=len(gen))).tolist(),
        }
    )
    result = {
        "responses_create_params": {
            "input": [
                {"role": "system", "content": "You are a visual assistant."},
                {
                    "role": "user",
                    "content": [image(), image(), {"type": "input_text", "text": "Click the red one."}],
                },
            ],
            "tools": [
                {"type": "function", "name": "click", "parameters": {"type": "object"}, "strict": True}
            ],
        },
        "response": {"id": "resp_bench", "model": "bench", "object": "response", "output": output},
        "reward": 1.0,
        "mask_sample": False,
        "_ng_task_index": 0,
        "_ng_rollout_index": 0,
    }
    return json.dumps(result).encode()


def _median_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--mb", type=float, default=5.0, help="target size of the result (MB)")
    parser.add_argument("--turns", type=int, default=10, help="model calls in the rollout (>= 8)")
    parser.add_argument("--repeat", type=int, default=15, help="timed runs per method (median reported)")
    args = parser.parse_args()

    raw = build_result(args.mb, args.turns)
    parsed = p.parse_run_result(raw)
    assert p.dump(parsed) == json.loads(raw), "round trip must be lossless"
    as_dict = json.loads(raw)
    n_items = len(parsed.response.output)

    rows: list[tuple[str, Callable[[], object]]] = [
        ("json.loads(bytes)", lambda: json.loads(raw)),
        ("orjson.loads(bytes)", lambda: orjson.loads(raw)),
        ("gymbridge parse_run_result(bytes)", lambda: p.parse_run_result(raw)),
        ("json.loads + parse_run_result(dict)", lambda: p.parse_run_result(json.loads(raw))),
        ("gymbridge dump_json(model)", lambda: p.dump_json(parsed)),
        ("json.dumps(dict)", lambda: json.dumps(as_dict)),
    ]
    results = [(name, _median_ms(fn, args.repeat)) for name, fn in rows]
    base = results[0][1]
    size = f"{len(raw) / 1e6:.2f} MB"
    print(f"payload: {size}, {args.turns} model calls, {n_items} output items; median of {args.repeat} runs")
    print(f"{'method':<38} {'ms':>9} {'x json.loads':>13}")
    for name, ms in results:
        print(f"{name:<38} {ms:>9.2f} {ms / base:>13.2f}")


if __name__ == "__main__":
    main()
