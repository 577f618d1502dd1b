"""Helpers shared by the trajectory tests: golden loading and a comparable trajectory summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gymbridge.trajectory import Trajectory

GOLDEN = Path(__file__).parent / "golden"
GOLDEN_NAMES = sorted(p.name.removesuffix(".expected.json") for p in GOLDEN.glob("*.expected.json"))


def load_golden(name: str) -> tuple[bytes, Any]:
    raw = (GOLDEN / f"{name}.json").read_bytes()
    expected = json.loads((GOLDEN / f"{name}.expected.json").read_text())
    return raw, expected


def media_ref(item: Any) -> dict[str, str]:
    if item.source.startswith("data:"):
        return {"modality": item.modality, "key": item.key}
    return {"modality": item.modality, "source": item.source}


def summary(traj: Trajectory, result: dict[str, Any]) -> dict[str, Any]:
    """The trajectory as the golden ``expected`` files state it."""
    output = result["response"]["output"]
    out: dict[str, Any] = {
        "turns": [
            {
                "kind": t.kind,
                "item_index": t.item_index,
                "segment": t.segment,
                "media": [media_ref(m) for m in t.media],
                "tool_name": t.tool_name,
                "tool_names": t.tool_names,
                "invalid_tool_call": t.invalid_tool_call,
                "malformed_thinking": t.malformed_thinking,
                "prompt_is_full": t.index > 0
                and t.prompt_token_ids == output[t.item_index]["prompt_token_ids"],
            }
            for t in traj.turns
        ],
        "reward": traj.reward,
        "truncated": traj.truncated,
        "num_segments": traj.num_segments,
        "task_index": traj.task_index,
        "rollout_index": traj.rollout_index,
    }
    if traj.reward_components:
        out["reward_components"] = traj.reward_components
    return out


# ----------------------------------------------------------------------------- small builders


def png_bytes(color: tuple[int, int, int] = (200, 30, 30), size: int = 4) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, format="PNG")
    return buf.getvalue()


def png_url(color: tuple[int, int, int] = (200, 30, 30), size: int = 4) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(png_bytes(color, size)).decode()


def image_part(url: str) -> dict[str, Any]:
    return {"type": "input_image", "image_url": url, "detail": "auto"}


def user_msg(content: Any, role: str = "user") -> dict[str, Any]:
    return {"type": "message", "role": role, "content": content}


def tok(prompt: list[int], gen: list[int], logprobs: list[float] | None = None) -> dict[str, Any]:
    return {
        "prompt_token_ids": prompt,
        "generation_token_ids": gen,
        "generation_log_probs": logprobs if logprobs is not None else [-0.5] * len(gen),
    }


def assistant(text: str, **tokens: Any) -> dict[str, Any]:
    return {
        "id": "msg",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
        **tokens,
    }


def reasoning_item(text: str, **tokens: Any) -> dict[str, Any]:
    return {"id": "rs", "type": "reasoning", "summary": [{"type": "summary_text", "text": text}], **tokens}


def call(name: str, call_id: str = "c1", **tokens: Any) -> dict[str, Any]:
    return {"type": "function_call", "name": name, "arguments": "{}", "call_id": call_id, **tokens}


def call_output(output: Any, call_id: str = "c1") -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def result(output: list[dict[str, Any]], input_items: Any = "hi", **top: Any) -> dict[str, Any]:
    res: dict[str, Any] = {
        "responses_create_params": {"input": input_items},
        "response": {"id": "resp_1", "object": "response", "output": output, "status": "completed"},
        "reward": 1.0,
    }
    res.update(top)
    return res
