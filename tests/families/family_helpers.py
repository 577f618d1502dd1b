"""Rollouts of the tiny families on two episode shapes, shared by the family matrix tests.

``rollouts(family, case)`` runs two GRPO groups of three native episodes against :class:`LookServer`
(one model server round trip per model call, in process) and returns the trajectories, the
generator inputs each call saw, and the generator. ``case``:

* ``prompt_image``: one 56 x 56 image in the prompt, one sampled answer;
* ``tool_image``: a 56 x 56 image in the prompt, a forced ``look`` call at turn 0 whose tool
  result is a 112 x 56 image, then a sampled answer that sees both (two images of two sizes in
  one row: Qwen grids of 4 and 8 tokens, InternVL's 1 and 3 tiles, Gemma 3's fixed 4 tokens);
* ``tool_video``: as ``tool_image`` with a forced ``watch`` call whose result is a 6-frame MP4
  (families whose tiny model takes video: :data:`VIDEO_FAMILIES`).

Rewards vary within each group (0, 1, 2), so advantages and the loss are nonzero. The episodes
of a (family, case) are run once per test process (cached).
"""

from __future__ import annotations

import asyncio
import functools
import io
import json
from dataclasses import dataclass, replace
from typing import Any

from PIL import Image

from gymbridge.generation.hf import HFGenerator
from gymbridge.generation.scripted import ScriptedGenerator
from gymbridge.generation.types import SamplingConfig
from gymbridge.media import encode_data_url
from gymbridge.models.tiny_families import TinyModel, tiny_model
from gymbridge.server import ResourcesServer, Session, ToolOutput, VerifyResult, image_part, tool, video_part
from gymbridge.trajectory import Trajectory, from_gym_result
from gymbridge.trajectory.types import GenerationInput

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3", "internvl")
CASES = ("prompt_image", "tool_image")
VIDEO_FAMILIES = ("qwen2_5_vl", "qwen2_5_omni")
"""Families whose tiny model takes video (Qwen2.5-VL's ``second_per_grid_ts``, the omni thinker's)."""
TEMPERATURE = 0.8
GROUP_SIZE = 3
COLORS = ((200, 30, 30), (30, 60, 210))


def png(color: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    image = Image.new("RGB", size, color)
    image.putpixel((3, 5), (color[0] ^ 255, 7, 9))  # not a flat image: every patch differs a little
    image.save(buf, "PNG")
    return buf.getvalue()


def mp4(color: tuple[int, int, int], num_frames: int = 6, size: int = 64) -> bytes:
    """A square of ``color`` moving right, H.264 in MP4 at 2 fps (the bouncing_ball encoder)."""
    import numpy as np

    from gymbridge_envs.bouncing_ball.data import encode_mp4

    frames = np.zeros((num_frames, size, size, 3), dtype=np.uint8)
    for i in range(num_frames):
        frames[i, 8 + 4 * i : 20 + 4 * i, 10:22] = color
    return encode_mp4(frames, 2)


class LookServer(ResourcesServer):
    """``look`` shows a wide image of the row's colour, ``watch`` a video of it; every answer is rewarded 1
    (the tests set rewards)."""

    async def seed_session(self, session: Session, row: dict[str, Any]) -> dict[str, Any]:
        session.state["color"] = list(row["color"])
        return {}

    @tool
    async def look(self, session: Session) -> ToolOutput:
        """Show the image."""
        color = tuple(session.state["color"])
        return ToolOutput(
            text="The image:", media=[image_part(png((color[2], color[1], color[0]), (112, 56)))]
        )

    @tool
    async def watch(self, session: Session) -> ToolOutput:
        """Play the video."""
        return ToolOutput(text="The video:", media=[video_part(mp4(tuple(session.state["color"])))])

    async def verify(self, session: Session, row: dict[str, Any], response: dict[str, Any]) -> VerifyResult:
        return VerifyResult(reward=1.0)


def row(color: tuple[int, int, int]) -> dict[str, Any]:
    image = {
        "type": "input_image",
        "image_url": encode_data_url(png(color, (56, 56)), "image/png"),
        "detail": "auto",
    }
    return {
        "color": list(color),
        "responses_create_params": {
            "input": [
                {"role": "user", "content": [image, {"type": "input_text", "text": "What colour is it?"}]}
            ],
            "tools": [
                {
                    "type": "function",
                    "name": name,
                    "description": f"Show the {what}.",
                    "parameters": {"type": "object", "properties": {}},
                }
                for name, what in (("look", "image"), ("watch", "video"))
            ],
            "max_output_tokens": 6,
            "temperature": TEMPERATURE,
        },
    }


def call_tokens(gen: HFGenerator, name: str) -> list[int]:
    text = "<tool_call>\n" + json.dumps({"name": name, "arguments": {}}) + "\n</tool_call>"
    return [int(t) for t in gen.tokenizer(text, add_special_tokens=False)["input_ids"]] + [
        gen.codec.end_of_turn_id
    ]


@dataclass(frozen=True)
class Rollouts:
    family: str
    case: str
    tiny: TinyModel
    generator: HFGenerator
    trajectories: list[Trajectory]
    inputs_seen: list[GenerationInput]
    """Every model call's generator input (full prompt and all media so far), in call order."""


async def _run(family: str, case: str) -> Rollouts:
    from gymbridge.rollout import NativeModel, run_episode
    from gymbridge.server import start_server

    tiny = tiny_model(family)
    gen = HFGenerator(tiny.model, tiny.processor, max_model_len=2048)
    trajectories: list[Trajectory] = []
    seen: list[GenerationInput] = []
    async with await start_server(LookServer()) as env:
        for task, color in enumerate(COLORS):
            for k in range(GROUP_SIZE):
                tool_name = {"tool_image": "look", "tool_video": "watch"}.get(case)
                script = [call_tokens(gen, tool_name), None] if tool_name else [None]
                scripted = ScriptedGenerator(gen, script)
                sampling = SamplingConfig(temperature=TEMPERATURE, max_tokens=6, seed=10 * task + k)
                model = NativeModel(scripted, gen.codec, max_model_len=gen.max_model_len, sampling=sampling)
                result = await run_episode(scripted, env.url, row(color), max_turns=3, model=model)
                traj = from_gym_result(result)
                trajectories.append(replace(traj, reward=float(k), task_index=task, rollout_index=k))
                seen.extend(scripted.inputs_seen)
    return Rollouts(family, case, tiny, gen, trajectories, seen)


@functools.cache
def rollouts(family: str, case: str) -> Rollouts:
    """The episodes of ``family`` x ``case`` (module docstring), run once per process."""
    return asyncio.run(_run(family, case))
