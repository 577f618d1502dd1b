"""Write the golden Gym results under ``tests/trajectory/golden/`` (run by hand, output committed).

Each golden is a ``/run`` verify result in NeMo Gym 0.7.0's exact JSON shapes
(``NeMoGymResponse.model_dump(mode="json")`` of the agents in
``responses_api_agents/simple_agent``, ``gymnasium_agent`` and
``simple_agent_with_compaction``), with the training-mode token fields on the last
output item of each model call. Next to it, ``<name>.expected.json`` states what
``from_gym_result`` must return, derived here from how the result was *built*
(which image was injected before which model call), not from running the code
under test.

    .venv/bin/python tests/trajectory/make_goldens.py
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import math
import struct
import wave
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

GOLDEN = Path(__file__).parent / "golden"

VISION_START, IMAGE_PAD, VISION_END = 151652, 151655, 151653
AUDIO_PAD, VIDEO_PAD = 151646, 151656
IM_START, IM_END = 151644, 151645


# ----------------------------------------------------------------------------- assets


def png(color: tuple[int, int, int], size: int = 8) -> bytes:
    img = Image.new("RGB", (size, size), (255, 255, 255))
    ImageDraw.Draw(img).ellipse((1, 1, size - 2, size - 2), fill=color)
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def wav(seconds: float = 0.05, rate: int = 8000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        n = int(seconds * rate)
        w.writeframes(b"".join(struct.pack("<h", int(8000 * math.sin(i / 5))) for i in range(n)))
    return buf.getvalue()


def data_url(raw: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def key(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


RED, GREEN, BLUE, YELLOW = png((220, 30, 30)), png((30, 200, 30)), png((30, 30, 220)), png((230, 210, 20))


# ----------------------------------------------------------------------------- Gym shapes


def image_part(raw: bytes) -> dict[str, Any]:
    return {"detail": "auto", "type": "input_image", "image_url": data_url(raw, "image/png")}


def text_part(text: str) -> dict[str, Any]:
    return {"text": text, "type": "input_text"}


def user(content: Any, role: str = "user") -> dict[str, Any]:
    return {"content": content, "role": role, "type": "message", "phase": None}


def tokens(prompt: list[int], generation: list[int]) -> dict[str, Any]:
    # logprobs: exactly representable values so the JSON round trip is exact
    return {
        "prompt_token_ids": prompt,
        "generation_token_ids": generation,
        "generation_log_probs": [-0.125 * (1 + (i % 4)) for i in range(len(generation))],
    }


def fn_call(name: str, arguments: str, call_id: str, tok: dict[str, Any] | None = None) -> dict[str, Any]:
    item = {
        "arguments": arguments,
        "call_id": call_id,
        "name": name,
        "type": "function_call",
        "id": call_id,
        "status": "completed",
        "namespace": None,
    }
    return item | (tok or {})


def fn_output(call_id: str, output: Any) -> dict[str, Any]:
    return {"call_id": call_id, "output": output, "type": "function_call_output", "id": None, "status": None}


def message(text: str, msg_id: str, tok: dict[str, Any] | None = None) -> dict[str, Any]:
    item = {
        "id": msg_id,
        "content": [{"annotations": [], "text": text, "type": "output_text", "logprobs": None}],
        "role": "assistant",
        "status": "completed",
        "type": "message",
        "phase": None,
    }
    return item | (tok or {})


def reasoning(text: str, rs_id: str, tok: dict[str, Any] | None = None) -> dict[str, Any]:
    item = {
        "id": rs_id,
        "summary": [{"text": text, "type": "summary_text"}],
        "type": "reasoning",
        "encrypted_content": None,
        "content": None,
    }
    return item | (tok or {})


CLICK_TOOL = {
    "name": "click",
    "parameters": {
        "type": "object",
        "properties": {
            "x": {"type": "integer", "description": "X pixel coordinate (single integer, not a list)"},
            "y": {"type": "integer", "description": "Y pixel coordinate (single integer, not a list)"},
        },
        "required": ["x", "y"],
        "additionalProperties": False,
    },
    "strict": True,
    "type": "function",
    "description": "Click at pixel coordinates (x, y) in the image.",
}


def counter_tool(name: str, props: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "parameters": {
            "type": "object",
            "properties": props,
            "required": list(props),
            "additionalProperties": False,
        },
        "strict": True,
        "type": "function",
        "description": "",
    }


COUNTER_TOOLS = [
    counter_tool("increment_counter", {"count": {"type": "integer", "description": ""}}),
    counter_tool("get_counter_value", {}),
]


def create_params(
    input_items: Any, tools: list[dict[str, Any]] | None = None, **extra: Any
) -> dict[str, Any]:
    params: dict[str, Any] = {
        "background": None,
        "include": None,
        "input": input_items,
        "instructions": None,
        "max_output_tokens": None,
        "max_tool_calls": None,
        "metadata": None,
        "model": None,
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "prompt": None,
        "reasoning": None,
        "service_tier": None,
        "store": None,
        "temperature": None,
        "text": None,
        "tool_choice": "auto",
        "tools": tools or [],
        "top_logprobs": None,
        "top_p": None,
        "truncation": None,
        "user": None,
        "stream": None,
    }
    params.update(extra)
    return params


def response(
    output: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, **extra: Any
) -> dict[str, Any]:
    resp: dict[str, Any] = {
        "id": "resp_" + hashlib.md5(json.dumps(output, sort_keys=True).encode()).hexdigest(),
        "created_at": 1772875669.0,
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "metadata": None,
        "model": "Qwen/Qwen3-VL-2B-Instruct",
        "object": "response",
        "output": output,
        "parallel_tool_calls": True,
        "temperature": None,
        "tool_choice": "auto",
        "tools": tools or [],
        "top_p": None,
        "background": None,
        "conversation": None,
        "max_output_tokens": None,
        "max_tool_calls": None,
        "previous_response_id": None,
        "prompt": None,
        "prompt_cache_key": None,
        "reasoning": None,
        "safety_identifier": None,
        "service_tier": None,
        "status": "completed",
        "text": None,
        "top_logprobs": None,
        "truncation": None,
        "usage": {
            "input_tokens": 100,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 20,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 120,
        },
        "user": None,
    }
    resp.update(extra)
    return resp


def image_tokens(n: int = 1) -> list[int]:
    return [VISION_START, *([IMAGE_PAD] * 4), VISION_END] * n


class Conv:
    """Builds consistent token streams: each prompt extends the previous prompt + generation."""

    def __init__(self, first_prompt: list[int]) -> None:
        self.seen: list[int] = []
        self.pending = list(first_prompt)
        self.next_id = 1000

    def observe(self, toks: list[int]) -> None:
        self.pending.extend(toks)

    def call(self, n_gen: int) -> dict[str, Any]:
        prompt = self.seen + self.pending
        gen = list(range(self.next_id, self.next_id + n_gen))
        self.next_id += n_gen
        self.seen = prompt + gen
        self.pending = [IM_END, IM_START, 77]
        return tokens(prompt, gen)


def expected_turn(
    kind: str,
    item_index: int,
    media: list[dict[str, str]],
    *,
    segment: int = 0,
    tool_name: str | None = None,
    tool_names: list[str] | None = None,
    invalid_tool_call: bool = False,
    malformed_thinking: bool = False,
    full_prompt: bool = False,
) -> dict[str, Any]:
    return {
        "kind": kind,
        "item_index": item_index,
        "segment": segment,
        "media": media,
        "tool_name": tool_name,
        "tool_names": tool_names if tool_names is not None else ([tool_name] if tool_name else []),
        "invalid_tool_call": invalid_tool_call,
        "malformed_thinking": malformed_thinking,
        "prompt_is_full": full_prompt,
    }


def img(raw: bytes) -> dict[str, str]:
    return {"modality": "image", "key": key(raw)}


# ----------------------------------------------------------------------------- goldens


def circle_click() -> tuple[dict[str, Any], dict[str, Any]]:
    sys_text = "You are a visual assistant. Use the click tool to click on the requested circle."
    inp = [
        user(sys_text, role="system"),
        user([image_part(RED), text_part("This is an 8x8 pixel image. Click on the red circle.")]),
    ]
    conv = Conv([IM_START, 1, 2, 3, IM_END, IM_START, 4, *image_tokens(), 5, 6])
    out = [
        fn_call("click", '{"x": 4, "y": 4}', "chatcmpl-tool-86cdcf91d9b35f2e", conv.call(9)),
        fn_output("chatcmpl-tool-86cdcf91d9b35f2e", '{"x":4,"y":4}'),
    ]
    result = {
        "responses_create_params": create_params(inp, [CLICK_TOOL]),
        "response": response(out, [CLICK_TOOL]),
        "reward": 1.0,
        "clicked_x": 4,
        "clicked_y": 4,
        "hit": True,
        "mask_sample": False,
        "failure_kind": None,
        "failure_reason": None,
        "_ng_task_index": 4,
        "_ng_rollout_index": 0,
    }
    expected = {
        "turns": [expected_turn("function_call", 0, [img(RED)], tool_name="click")],
        "reward": 1.0,
        "truncated": False,
        "num_segments": 1,
        "task_index": 4,
        "rollout_index": 0,
    }
    return result, expected


def stateful_counter() -> tuple[dict[str, Any], dict[str, Any]]:
    inp = [user("add 13 then add 14 then get the count")]
    conv = Conv([IM_START, 10, 11, 12, IM_END])
    out: list[dict[str, Any]] = [
        reasoning("I need to add 13 and 14.", "rs_1"),
        fn_call("increment_counter", '{"count":13}', "call_a"),
        fn_call("increment_counter", '{"count":14}', "call_b", conv.call(24)),
    ]
    out += [fn_output("call_a", '{"success": true}'), fn_output("call_b", '{"success": true}')]
    conv.observe([20, 21, 22])
    out += [
        reasoning("Now read the counter.", "rs_2"),
        fn_call("get_counter_value", "{}", "call_c", conv.call(12)),
        fn_output("call_c", '{"count": 42}'),
    ]
    conv.observe([23, 24])
    out += [
        reasoning("The counter is 42.", "rs_3"),
        message(
            "You asked to add 13, then add 14, and finally get the count. The count is 42.",
            "msg_1",
            conv.call(20),
        ),
    ]
    result = {
        "responses_create_params": create_params(inp, COUNTER_TOOLS),
        "response": response(out, COUNTER_TOOLS),
        "reward": 1.0,
        "expected_count": 42,
        "initial_count": 15,
        "mask_sample": False,
        "failure_kind": None,
        "failure_reason": None,
        "_ng_task_index": 0,
        "_ng_rollout_index": 3,
    }
    expected = {
        "turns": [
            expected_turn(
                "function_call", 2, [], tool_name="increment_counter", tool_names=["increment_counter"] * 2
            ),
            expected_turn("function_call", 6, [], tool_name="get_counter_value"),
            expected_turn("message", 9, []),
        ],
        "reward": 1.0,
        "truncated": False,
        "num_segments": 1,
        "task_index": 0,
        "rollout_index": 3,
    }
    return result, expected


def reasoning_only_turn() -> tuple[dict[str, Any], dict[str, Any]]:
    """simple_agent: a tool image, then a reasoning-only call that ends the rollout incomplete."""
    inp = [user([image_part(RED), text_part("Which circle is red? Use the click tool.")])]
    conv = Conv([IM_START, 4, *image_tokens(), 5, IM_END])
    out = [
        fn_call("click", '{"x": 4, "y": 4}', "call_1", conv.call(9)),
        fn_output("call_1", data_url(GREEN, "image/png")),
    ]
    conv.observe(image_tokens())
    out.append(
        reasoning("The screenshot changed; the circle is now green. Let me think.", "rs_1", conv.call(15))
    )
    resp = response(out, [CLICK_TOOL], status="incomplete")
    resp["metadata"] = {
        "ng_termination_reason": "incomplete_reasoning",
        "ng_termination_message": "Ending trajectory: model returned no assistant message or tool calls "
        "(reasoning-only or empty output) without reported truncation.",
    }
    result = {
        "responses_create_params": create_params(inp, [CLICK_TOOL]),
        "response": resp,
        "reward": 0.0,
        "mask_sample": False,
        "failure_kind": None,
        "failure_reason": None,
        "_ng_task_index": 1,
        "_ng_rollout_index": 0,
    }
    expected = {
        "turns": [
            expected_turn("function_call", 0, [img(RED)], tool_name="click"),
            expected_turn("reasoning", 2, [img(GREEN)]),
        ],
        "reward": 0.0,
        "truncated": True,
        "num_segments": 1,
        "task_index": 1,
        "rollout_index": 0,
    }
    return result, expected


def function_call_image_output(form: str) -> tuple[dict[str, Any], dict[str, Any]]:
    inp = [user([image_part(RED), text_part("Zoom into the circle, then say its color.")])]
    conv = Conv([IM_START, 4, *image_tokens(), 5, IM_END])
    tool_out: Any = (
        data_url(BLUE, "image/png") if form == "string" else [text_part("zoomed view:"), image_part(BLUE)]
    )
    out = [
        fn_call("zoom", '{"x": 4, "y": 4, "factor": 2}', "call_z", conv.call(11)),
        fn_output("call_z", tool_out),
    ]
    conv.observe(image_tokens())
    out.append(message("The zoomed circle is blue.", "msg_1", conv.call(7)))
    result = {
        "responses_create_params": create_params(inp),
        "response": response(out),
        "reward": 1.0,
        "_ng_task_index": 7,
        "_ng_rollout_index": 1,
    }
    expected = {
        "turns": [
            expected_turn("function_call", 0, [img(RED)], tool_name="zoom"),
            expected_turn("message", 2, [img(BLUE)]),
        ],
        "reward": 1.0,
        "truncated": False,
        "num_segments": 1,
        "task_index": 7,
        "rollout_index": 1,
    }
    return result, expected


def user_injected_image() -> tuple[dict[str, Any], dict[str, Any]]:
    """gymnasium_agent with gymbridge observations: the tool's screenshot comes as a user message."""
    inp = [user("Click the yellow circle."), user([image_part(YELLOW)])]
    conv = Conv([IM_START, 8, 9, *image_tokens(), IM_END])
    out = [
        fn_call("click", '{"x": 2, "y": 6}', "call_1", conv.call(9)),
        fn_output("call_1", "clicked"),
        user([text_part("New screenshot:"), image_part(GREEN)]),
    ]
    conv.observe(image_tokens())
    out.append(message("Done.", "msg_1", conv.call(3)))
    result = {
        "responses_create_params": create_params(inp, [CLICK_TOOL]),
        "response": response(out, [CLICK_TOOL]),
        "reward": 0.5,
        "reward_components": {"hit": 0.25, "format": 0.25},
        "terminated": True,
        "truncated": False,
        "info": {},
        "_ng_task_index": 2,
        "_ng_rollout_index": 5,
    }
    expected = {
        "turns": [
            expected_turn("function_call", 0, [img(YELLOW)], tool_name="click"),
            expected_turn("message", 3, [img(GREEN)]),
        ],
        "reward": 0.5,
        "reward_components": {"hit": 0.25, "format": 0.25},
        "truncated": False,
        "num_segments": 1,
        "task_index": 2,
        "rollout_index": 5,
    }
    return result, expected


def empty_generation() -> tuple[dict[str, Any], dict[str, Any]]:
    """The second call generated nothing (simple_agent 'empty_output'): not a turn."""
    inp = [user([image_part(RED), text_part("Click the circle.")])]
    conv = Conv([IM_START, 4, *image_tokens(), 5, IM_END])
    out = [
        fn_call("click", '{"x": 4, "y": 4}', "call_1", conv.call(9)),
        fn_output("call_1", '{"x":4,"y":4}'),
    ]
    conv.observe([30])
    empty = conv.call(0)
    out.append(message("", "msg_empty", empty))
    resp = response(out, [CLICK_TOOL], status="incomplete")
    resp["metadata"] = {"ng_termination_reason": "empty_output", "ng_termination_message": "..."}
    result = {
        "responses_create_params": create_params(inp, [CLICK_TOOL]),
        "response": resp,
        "reward": 0.0,
        "_ng_task_index": 3,
        "_ng_rollout_index": 2,
    }
    expected = {
        "turns": [expected_turn("function_call", 0, [img(RED)], tool_name="click")],
        "reward": 0.0,
        "truncated": True,
        "num_segments": 1,
        "task_index": 3,
        "rollout_index": 2,
    }
    return result, expected


AUDIO = wav()


def audio_metadata() -> tuple[dict[str, Any], dict[str, Any]]:
    """asr_with_pc: the audio travels in responses_create_params.metadata.audio_data."""
    inp = [
        user("You are a helpful assistant. /no_think", role="system"),
        user("Transcribe the audio with proper punctuation and capitalization."),
    ]
    conv = Conv([IM_START, 1, IM_END, IM_START, 2, *([AUDIO_PAD] * 5), IM_END])
    out = [message("She sells seashells by the seashore.", "msg_1", conv.call(9))]
    params = create_params(inp, metadata={"audio_data": data_url(AUDIO, "audio/wav")})
    result = {
        "responses_create_params": params,
        "response": response(out),
        "reward": 1.0,
        "expected_answer": "She sells seashells by the seashore.",
        "sample_id": "example-02",
        "_ng_task_index": 1,
        "_ng_rollout_index": 0,
    }
    expected = {
        "turns": [expected_turn("message", 0, [{"modality": "audio", "key": key(AUDIO)}])],
        "reward": 1.0,
        "truncated": False,
        "num_segments": 1,
        "task_index": 1,
        "rollout_index": 0,
    }
    return result, expected


VIDEO_URL = "file:///data/gymbridge-golden/videos/clip_0001.mp4"


def video_part() -> tuple[dict[str, Any], dict[str, Any]]:
    inp = [
        user(
            [
                {"type": "input_video", "video_url": VIDEO_URL},
                text_part("How many times does the ball bounce?"),
            ]
        )
    ]
    conv = Conv([IM_START, 3, *([VIDEO_PAD] * 8), IM_END])
    out = [message("It bounces 3 times.", "msg_1", conv.call(6))]
    result = {
        "responses_create_params": create_params(inp),
        "response": response(out),
        "reward": 1.0,
        "_ng_task_index": 0,
        "_ng_rollout_index": 0,
    }
    expected = {
        "turns": [expected_turn("message", 0, [{"modality": "video", "source": VIDEO_URL}])],
        "reward": 1.0,
        "truncated": False,
        "num_segments": 1,
        "task_index": 0,
        "rollout_index": 0,
    }
    return result, expected


def non_appending_history() -> tuple[dict[str, Any], dict[str, Any]]:
    """The template strips turn 0's reasoning from the replayed history: turn 1's prompt diverges."""
    inp = [user([image_part(RED), text_part("Click the red circle.")])]
    first_prompt = [IM_START, 4, *image_tokens(), 5, IM_END, IM_START]
    reasoning_tokens = [500, 501, 502, 503]
    call_tokens = [600, 601, 602, 603, 604]
    out = [
        reasoning("Red is top-left.", "rs_1"),
        fn_call("click", '{"x": 4, "y": 4}', "call_1", tokens(first_prompt, reasoning_tokens + call_tokens)),
        fn_output("call_1", data_url(GREEN, "image/png")),
    ]
    # the re-rendered prompt drops the reasoning tokens: it no longer extends the history
    second_prompt = [*first_prompt, *call_tokens, IM_END, IM_START, *image_tokens(), IM_END, IM_START]
    out.append(message("I clicked it; it turned green.", "msg_1", tokens(second_prompt, [700, 701, 702])))
    third_prompt = [*second_prompt, 700, 701, 702, IM_END, IM_START, 40, IM_END, IM_START]
    out.append(user("Are you sure?"))
    out.append(message("Yes.", "msg_2", tokens(third_prompt, [710, 711])))
    result = {
        "responses_create_params": create_params(inp, [CLICK_TOOL]),
        "response": response(out, [CLICK_TOOL]),
        "reward": 1.0,
        "_ng_task_index": 9,
        "_ng_rollout_index": 0,
    }
    expected = {
        "error_item_index": 3,
        "split": {
            "turns": [
                expected_turn("function_call", 1, [img(RED)], tool_name="click"),
                # a new segment's first turn carries its full prompt and every media so far
                expected_turn("message", 3, [img(RED), img(GREEN)], segment=1, full_prompt=True),
                expected_turn("message", 5, [], segment=1),
            ],
            "reward": 1.0,
            "truncated": False,
            "num_segments": 2,
            "task_index": 9,
            "rollout_index": 0,
        },
    }
    return result, expected


def agent_input() -> tuple[dict[str, Any], dict[str, Any]]:
    """simple_agent_with_compaction (skip_verification): the agent's first input differs from the row's."""
    row_input = [user([image_part(RED), text_part("task")])]
    agent_in = [user([image_part(BLUE), text_part("task (re-rendered by the agent)")])]
    seed_obs = [user([text_part("Initial observation:"), image_part(YELLOW)])]
    conv = Conv([IM_START, 4, *image_tokens(2), 5, IM_END])
    out = [message("The circles are blue and yellow.", "msg_1", conv.call(8))]
    resp = response(out)
    resp["agent_input"] = agent_in
    resp["seed_obs"] = seed_obs
    result = {
        "responses_create_params": create_params(row_input),
        "response": resp,
        "reward": 0.25,
        "verification_skipped": True,
        "_ng_task_index": 5,
        "_ng_rollout_index": 1,
    }
    expected = {
        "turns": [expected_turn("message", 0, [img(BLUE), img(YELLOW)])],
        "reward": 0.25,
        "truncated": False,
        "num_segments": 1,
        "task_index": 5,
        "rollout_index": 1,
    }
    return result, expected


GOLDENS = {
    "circle_click_single_turn": circle_click,
    "stateful_counter_reasoning": stateful_counter,
    "reasoning_only_turn": reasoning_only_turn,
    "function_call_image_output_string": lambda: function_call_image_output("string"),
    "function_call_image_output_list": lambda: function_call_image_output("list"),
    "user_injected_image": user_injected_image,
    "empty_generation": empty_generation,
    "audio_metadata": audio_metadata,
    "video_part": video_part,
    "non_appending_history": non_appending_history,
    "agent_input_differs": agent_input,
}


def main() -> None:
    GOLDEN.mkdir(exist_ok=True)
    for name, build in GOLDENS.items():
        result, expected = build()
        (GOLDEN / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
        (GOLDEN / f"{name}.expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(GOLDENS)} goldens to {GOLDEN}")


if __name__ == "__main__":
    main()
