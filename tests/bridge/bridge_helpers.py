"""A fake Gym agent (httpx.MockTransport) whose /run results carry tiny-VLM tokens and an image."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable
from typing import Any

import httpx
from PIL import Image

from gymbridge.models.tiny_vlm import TinyVLM

TEXT = [40, 41, 42, 43]


def png_data_url(task: int) -> str:
    buf = io.BytesIO()
    img = Image.new("RGB", (56, 56), (30 * task % 255, 90, 160))
    img.putpixel((task % 56, 3), (255, 0, 0))
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def make_rows(n: int) -> list[dict[str, Any]]:
    return [
        {
            "responses_create_params": {
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": f"task {i}"},
                            {"type": "input_image", "image_url": png_data_url(i), "detail": "auto"},
                        ],
                    }
                ]
            },
            "task_id": f"t{i}",
        }
        for i in range(n)
    ]


def run_result(tiny: TinyVLM, row: dict[str, Any], reward: float, *, placeholders: int = 4) -> dict[str, Any]:
    r = int(row["_ng_rollout_index"])
    prompt = [
        tiny.im_start_token_id,
        *TEXT,
        tiny.vision_start_token_id,
        *[tiny.image_token_id] * placeholders,
    ]
    prompt += [tiny.vision_end_token_id, 44]
    gen = [60 + r, 70, tiny.eos_token_id]
    item = {
        "type": "message",
        "role": "assistant",
        "id": f"msg_{r}",
        "status": "completed",
        "content": [{"type": "output_text", "text": "ok", "annotations": []}],
        "prompt_token_ids": prompt,
        "generation_token_ids": gen,
        "generation_log_probs": [-1.0, -2.0, -0.5],
    }
    return {**row, "response": {"id": "resp", "output": [item], "status": "completed"}, "reward": reward}


Behaviour = Callable[[int, int], "float | int | str"]
"""(task, rollout) -> a float reward, an int HTTP status to fail with, "bad_tokens" (a prompt whose
placeholders do not match its image; "bad_tokens_masked": the same, marked ``mask_sample``) or
"sampled_pad" (a generation containing an image placeholder)."""


class FakeAgent:
    """Answers POST /run per ``behaviour``; records every row it was sent."""

    def __init__(self, tiny: TinyVLM, behaviour: Behaviour) -> None:
        self.tiny = tiny
        self.behaviour = behaviour
        self.seen: list[dict[str, Any]] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        row = json.loads(request.content)
        self.seen.append(row)
        what = self.behaviour(int(row["_ng_task_index"]), int(row["_ng_rollout_index"]))
        if isinstance(what, int) and not isinstance(what, bool):
            return httpx.Response(what, json={"detail": f"injected {what}"})
        if what in ("bad_tokens", "bad_tokens_masked"):
            result = run_result(self.tiny, row, 1.0, placeholders=3)
            if what == "bad_tokens_masked":
                result["mask_sample"] = True
            return httpx.Response(200, json=result)
        if what == "sampled_pad":
            result = run_result(self.tiny, row, 1.0)
            result["response"]["output"][0]["generation_token_ids"][1] = self.tiny.image_token_id
            return httpx.Response(200, json=result)
        return httpx.Response(200, json=run_result(self.tiny, row, float(what)))

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handler)
