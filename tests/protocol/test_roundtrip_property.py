"""Property: JSON -> model -> JSON loses nothing, for generated items, parts, rows and results.

The generators cover every modelled item and part type, unknown item/part/tool
types, unknown keys at every level, untyped messages, nested content, token fields
and unicode text; keys that are absent must stay absent.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gymbridge import protocol as p

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

text = st.text(st.characters(blacklist_categories=["Cs"]), max_size=12)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | text
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=6,
)
extras = st.dictionaries(text.map(lambda s: "x_" + s), json_values, max_size=2)


def obj(
    required: dict[str, Any], optional: dict[str, Any] | None = None
) -> st.SearchStrategy[dict[str, Any]]:
    """A JSON object with the required keys, some of the optional keys, and unknown keys."""
    base = st.fixed_dictionaries(required, optional=optional or {})
    return st.builds(lambda b, e: {**e, **b}, base, extras)


data_url = st.builds(
    lambda kind, raw: f"data:{kind};base64,{base64.b64encode(raw).decode()}",
    st.sampled_from(["image/png", "image/jpeg", "audio/wav", "video/mp4"]),
    st.binary(max_size=48),
)
url = data_url | st.sampled_from(["file:///data/a.png", "https://example.com/x.jpg", "/abs/path.mp4"])
status = st.sampled_from(["in_progress", "completed", "incomplete"]) | st.none()
unknown_type = text.map(lambda s: "x-" + s)


@st.composite
def tokens(draw: st.DrawFn) -> dict[str, Any]:
    if not draw(st.booleans()):
        return {}
    n = draw(st.integers(0, 6))
    out: dict[str, Any] = {
        "prompt_token_ids": draw(st.lists(st.integers(0, 2**31), max_size=8)),
        "generation_token_ids": draw(st.lists(st.integers(0, 2**31), min_size=n, max_size=n)),
        "generation_log_probs": draw(
            st.lists(st.floats(max_value=0.0, allow_nan=False, allow_infinity=False), min_size=n, max_size=n)
        ),
    }
    if draw(st.booleans()):
        out["routed_experts"] = draw(st.none() | text)
    return out


def with_tokens(strategy: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(lambda d, t: {**d, **t}, strategy, tokens())


parts = st.one_of(
    obj({"type": st.just("input_text"), "text": text}),
    obj(
        {"type": st.just("input_image"), "image_url": url},
        {"detail": st.sampled_from(["auto", "low", "high"]), "file_id": st.none() | text},
    ),
    obj({"type": st.just("input_audio"), "input_audio": obj({"data": text, "format": st.just("wav")})}),
    obj({"type": st.just("input_audio"), "audio_url": url}),
    obj({"type": st.just("input_video"), "video_url": url | obj({"url": url})}),
    obj({"type": st.just("input_video"), "video": url}),
    obj(
        {"type": st.just("output_text"), "text": text},
        {
            "annotations": st.lists(json_values, max_size=2),
            "logprobs": st.none() | st.lists(json_values, max_size=2),
        },
    ),
    obj({"type": st.just("refusal"), "refusal": text}),
    obj({"type": st.just("summary_text"), "text": text}),
    obj({"type": st.just("reasoning_text"), "text": text}),
    obj({"type": unknown_type}, {"payload": json_values}),
)
content = text | st.lists(parts, max_size=3)

items = st.one_of(
    with_tokens(
        obj(
            {"role": st.sampled_from(["user", "system", "developer"]), "content": content},
            {"type": st.just("message"), "status": status},
        )
    ),
    with_tokens(
        obj(
            {"role": st.just("assistant"), "content": content},
            {"type": st.just("message"), "id": st.none() | text, "status": status, "phase": st.none()},
        )
    ),
    with_tokens(
        obj(
            {"type": st.just("reasoning")},
            {
                "id": st.none() | text,
                "summary": st.lists(parts, max_size=2),
                "content": st.none() | st.lists(parts, max_size=2),
                "encrypted_content": st.none() | text,
            },
        )
    ),
    with_tokens(
        obj(
            {"type": st.just("function_call"), "call_id": text, "name": text, "arguments": text},
            {"id": st.none() | text, "status": status, "namespace": st.none()},
        )
    ),
    obj(
        {"type": st.just("function_call_output"), "call_id": text, "output": content},
        {"id": st.none() | text, "status": status},
    ),
    with_tokens(obj({"type": unknown_type}, {"payload": json_values})),
)

tools = st.lists(
    obj(
        {"type": st.just("function"), "name": text},
        {
            "parameters": st.none() | st.dictionaries(text, json_values, max_size=2),
            "strict": st.none() | st.booleans(),
        },
    )
    | obj({"type": unknown_type}),
    max_size=2,
)

create_params = obj(
    {"input": text | st.lists(items, max_size=4)},
    {
        "tools": tools,
        "model": st.none() | text,
        "temperature": st.none() | st.floats(0, 2),
        "max_output_tokens": st.none() | st.integers(1, 4096),
        "metadata": st.none() | st.dictionaries(text, text, max_size=2),
        "tool_choice": st.sampled_from(["auto", "none", "required"]),
        "parallel_tool_calls": st.booleans(),
    },
)

response = obj(
    # flat items, or transitions form (one item list per agent step, aviary/toolsandbox agents)
    {"output": st.lists(items, max_size=5) | st.lists(st.lists(items, max_size=3), min_size=1, max_size=3)},
    {
        "id": text,
        "created_at": st.floats(0, 2e9),
        "model": text,
        "object": st.just("response"),
        "status": st.none() | st.sampled_from(["completed", "incomplete"]),
        "usage": st.none() | st.dictionaries(text, json_values, max_size=2),
        "tools": tools,
    },
)

run_results = obj(
    {"responses_create_params": create_params, "response": response, "reward": st.floats(-10, 10)},
    {
        "reward_components": st.dictionaries(text, st.floats(-1, 1), max_size=3),
        "mask_sample": st.booleans(),
        "failure_kind": st.none() | text,
        "failure_reason": st.none() | text,
        "agent_ref": obj({"name": text}, {"type": st.just("responses_api_agents")}),
        "_ng_task_index": st.integers(0, 10**6),
        "_ng_rollout_index": st.integers(0, 64),
        "task_index": json_values,
        "terminated": st.booleans(),
        "info": st.dictionaries(text, json_values, max_size=2),
    },
)


@SETTINGS
@given(st.lists(items, max_size=6))
def test_items_round_trip(data: list[dict[str, Any]]) -> None:
    raw = json.dumps(data).encode()
    parsed = p.parse_items(raw)
    assert p.dump(parsed) == data
    assert json.loads(p.dump_json(parsed)) == data
    assert p.dump(p.parse_items(data)) == data


@SETTINGS
@given(st.lists(parts, max_size=6))
def test_parts_round_trip(data: list[dict[str, Any]]) -> None:
    assert p.dump(p.parse_content_parts(json.dumps(data))) == data


@SETTINGS
@given(run_results)
def test_run_result_round_trip(data: dict[str, Any]) -> None:
    raw = json.dumps(data, ensure_ascii=False).encode()
    parsed = p.parse_run_result(raw)
    assert p.dump(parsed) == data
    again = p.parse_run_result(p.dump_json(parsed))
    assert p.dump(again) == data
    assert p.dump(p.parse_run_result(data)) == data


@SETTINGS
@given(create_params)
def test_create_params_round_trip(data: dict[str, Any]) -> None:
    assert p.dump(p.parse_responses_create_params(json.dumps(data))) == data


step_bodies = obj(
    {},
    {
        "observation": st.none() | text,
        "reward": st.floats(-1, 1),
        "terminated": st.booleans(),
        "truncated": st.booleans(),
        "info": st.dictionaries(text, json_values, max_size=3),
        "observation_content": st.none() | st.lists(parts, max_size=3),
    },
)


@SETTINGS
@given(step_bodies)
def test_step_and_reset_bodies_round_trip(data: dict[str, Any]) -> None:
    assert p.dump(p.parse_step_response(json.dumps(data))) == data
    reset = {k: v for k, v in data.items() if k not in ("reward", "terminated", "truncated")}
    assert p.dump(p.parse_reset_response(json.dumps(reset))) == reset
