"""Golden files in NeMo Gym 0.7.0's exact shapes: parse them, check what a user reads, re-dump losslessly."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from gymbridge import protocol as p

GOLDEN = Path(__file__).parent / "golden"

CASES: list[tuple[str, Callable[[Any], BaseModel]]] = [
    ("run_row_circle_click.json", p.parse_run_request),
    ("run_result_circle_click.json", p.parse_run_result),
    ("verify_request_multireward.json", p.parse_verify_request),
    ("verify_response_multireward.json", p.parse_verify_response),
    ("gymnasium_reset_response.json", p.parse_reset_response),
    ("gymnasium_step_response.json", p.parse_step_response),
    ("gymnasium_step_response_stock.json", p.parse_step_response),
]


def _load(name: str) -> tuple[bytes, Any]:
    raw = (GOLDEN / name).read_bytes()
    return raw, json.loads(raw)


@pytest.mark.parametrize(("name", "parser"), CASES, ids=[c[0] for c in CASES])
def test_golden_round_trip_is_lossless(name: str, parser: Callable[[Any], BaseModel]) -> None:
    raw, expected = _load(name)
    from_bytes = parser(raw)
    assert p.dump(from_bytes) == expected
    assert json.loads(p.dump_json(from_bytes)) == expected
    # a decoded dict and a str parse the same way
    assert p.dump(parser(expected)) == expected
    assert p.dump(parser(raw.decode())) == expected
    # dump -> parse -> dump is a fixed point
    assert p.dump(parser(p.dump_json(from_bytes))) == expected


def test_golden_run_row_fields() -> None:
    row = p.parse_run_request(_load("run_row_circle_click.json")[0])
    assert row.task_index == 3 and row.rollout_index == 1
    assert row.agent_ref is not None and row.agent_ref.name == "circle_click_simple_agent"
    assert row.model_extra == {
        "circles": [{"x": 8, "y": 8, "radius": 5, "color": "red"}],
        "target_color": "red",
    }
    params = row.responses_create_params
    assert params.non_gym_keys == []
    system, user = params.input_items
    assert isinstance(system, p.InputMessage) and system.role == "system"
    assert "type" not in p.dump(system)  # absent on the wire, absent on dump
    assert isinstance(user, p.InputMessage)
    media = list(p.iter_media_parts(user.content))
    assert len(media) == 1 and isinstance(media[0], p.InputImagePart)
    assert media[0].source is not None and media[0].source.startswith("data:image/png;base64,iVBOR")
    (tool,) = params.tools
    assert isinstance(tool, p.FunctionTool) and tool.name == "click" and tool.strict is True


def test_golden_run_result_fields() -> None:
    result = p.parse_run_result(_load("run_result_circle_click.json")[0])
    assert result.reward == 1.0 and result.mask_sample is False and result.failure_kind is None
    assert result.model_extra is not None and result.model_extra["hit"] is True
    out = result.response.output
    assert [type(i).__name__ for i in out] == [
        "ReasoningItem",
        "FunctionCallItem",
        "FunctionCallOutputItem",
        "AssistantMessage",
    ]
    reasoning, call, tool_out, answer = out
    assert isinstance(reasoning, p.ReasoningItem) and not reasoning.has_token_fields
    assert isinstance(call, p.FunctionCallItem) and call.has_token_fields
    assert json.loads(call.arguments) == {"x": 8, "y": 8}
    assert call.generation_token_ids is not None and call.generation_log_probs is not None
    assert len(call.generation_token_ids) == len(call.generation_log_probs) == 17
    assert isinstance(tool_out, p.FunctionCallOutputItem) and tool_out.call_id == call.call_id
    assert isinstance(answer, p.AssistantMessage) and answer.text.startswith("I clicked")
    # token prefix invariant of the golden data: the second call's prompt extends the first call
    assert answer.prompt_token_ids is not None and call.prompt_token_ids is not None
    first = call.prompt_token_ids + call.generation_token_ids
    assert answer.prompt_token_ids[: len(first)] == first
    assert [type(i).__name__ for i in result.response.generated_items] == [
        "ReasoningItem",
        "FunctionCallItem",
        "AssistantMessage",
    ]
    assert result.response.output_text == answer.text
    assert result.task_index is None  # circle_click's /verify does not echo _ng_* keys


def test_golden_verify_bodies() -> None:
    request = p.parse_verify_request(_load("verify_request_multireward.json")[0])
    assert request.task_index == 1 and request.rollout_index == 0
    assert request.model_extra == {
        "expected_call": {"name": "get_weather", "arguments": {"city": "New York"}}
    }
    response = p.parse_verify_response(_load("verify_response_multireward.json")[0])
    assert response.reward_components == {"correctness": 1.0, "schema_valid": 1.0, "format": 1.0}
    assert sum(response.reward_components.values()) == response.reward


def test_golden_gymnasium_bodies() -> None:
    reset = p.parse_reset_response(_load("gymnasium_reset_response.json")[0])
    assert reset.info["supports_explicit_close"] is True
    assert reset.observation_content is not None
    assert [part.type for part in reset.observation_content] == ["input_text", "input_image"]
    step = p.parse_step_response(_load("gymnasium_step_response.json")[0])
    assert step.observation == "You moved right. The goal is one cell below you."
    assert step.terminated is False and step.reward == 0.0
    assert step.info["tool_outputs"][0]["call_id"] == "call_7f3a"
    stock = p.parse_step_response(_load("gymnasium_step_response_stock.json")[0])
    assert stock.observation is None and stock.observation_content is None and stock.terminated is True
    assert "observation_content" not in p.dump(stock)
