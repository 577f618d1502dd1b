"""Behaviour of the wire models: token-field rules, passthrough, strict output, clear errors."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from gymbridge import protocol as p
from gymbridge.errors import GymbridgeError, ProtocolError


def _result(output: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "responses_create_params": {"input": "hi"},
        "response": {"id": "resp_1", "output": output},
        "reward": 1.0,
        **extra,
    }


def _call(**tokens: Any) -> dict[str, Any]:
    return {"type": "function_call", "call_id": "c1", "name": "click", "arguments": "{}", **tokens}


TOKENS = {
    "prompt_token_ids": [1, 2],
    "generation_token_ids": [3, 4, 5],
    "generation_log_probs": [-0.1, -0.2, 0],
}


# ---------------------------------------------------------------- token fields


def test_complete_token_fields_parse() -> None:
    result = p.parse_run_result(json.dumps(_result([_call(**TOKENS)])))
    (item,) = result.response.output
    assert isinstance(item, p.FunctionCallItem)
    assert item.generation_token_ids == [3, 4, 5]
    assert item.generation_log_probs == [-0.1, -0.2, 0.0]


@pytest.mark.parametrize("missing", ["prompt_token_ids", "generation_token_ids", "generation_log_probs"])
def test_partial_token_fields_name_the_missing_field(missing: str) -> None:
    tokens = {k: v for k, v in TOKENS.items() if k != missing}
    with pytest.raises(ProtocolError) as info:
        p.parse_run_result(
            json.dumps(_result([{"type": "message", "role": "user", "content": "x"}, _call(**tokens)]))
        )
    message = str(info.value)
    assert f"missing {missing}" in message
    assert "response.output.1" in message  # the location names the offending item
    assert isinstance(info.value.__cause__, ValidationError)
    first = info.value.errors[0]
    assert isinstance(first, dict) and first["loc"][:3] == ("response", "output", 1)


def test_logprob_length_mismatch_is_a_protocol_error() -> None:
    tokens = {**TOKENS, "generation_log_probs": [-0.1, -0.2]}
    with pytest.raises(
        ProtocolError, match="generation_log_probs has 2 entries but generation_token_ids has 3"
    ):
        p.parse_run_result(json.dumps(_result([_call(**tokens)])))


def test_null_token_field_is_refused() -> None:
    with pytest.raises(ProtocolError, match="got null for generation_log_probs"):
        p.parse_items(json.dumps([_call(**{**TOKENS, "generation_log_probs": None})]))


@pytest.mark.parametrize("bad", [["1"], [1.0], [True]])
def test_token_ids_are_not_coerced(bad: list[Any]) -> None:
    with pytest.raises(ProtocolError, match="prompt_token_ids"):
        p.parse_items(json.dumps([_call(**{**TOKENS, "prompt_token_ids": bad})]))


def test_routed_experts_alone_is_refused_and_kept_with_tokens() -> None:
    with pytest.raises(ProtocolError, match="must come together"):
        p.parse_items(json.dumps([_call(routed_experts="nrlre1:int8:1x1x1:AA==")]))
    items = p.parse_items(json.dumps([_call(**TOKENS, routed_experts="nrlre1:int8:3x1x1:AAAA")]))
    assert p.dump(items)[0]["routed_experts"] == "nrlre1:int8:3x1x1:AAAA"


def test_token_fields_on_unknown_items_are_checked_not_ignored() -> None:
    with pytest.raises(ProtocolError, match="must come together"):
        p.parse_items(json.dumps([{"type": "mcp_call", "prompt_token_ids": [1]}]))
    (item,) = p.parse_items(json.dumps([{"type": "mcp_call", **TOKENS}]))
    assert isinstance(item, p.UnknownItem) and item.has_token_fields


def test_drop_token_fields_keeps_everything_else() -> None:
    (item,) = p.parse_items(json.dumps([_call(**TOKENS, routed_experts=None, x_extra=1)]))
    assert isinstance(item, p.FunctionCallItem)
    assert p.dump(item.drop_token_fields()) == _call(x_extra=1)


def test_python_built_item_with_none_tokens_writes_no_token_fields() -> None:
    item = p.FunctionCallItem(call_id="c", name="n", arguments="{}", prompt_token_ids=None)
    assert not item.has_token_fields
    assert not set(p.TOKEN_FIELDS) & set(item.to_dict())


def test_python_built_item_checks_token_fields_too() -> None:
    with pytest.raises(ValidationError, match="must be equally long"):
        p.AssistantMessage(
            content="x", prompt_token_ids=[1], generation_token_ids=[2], generation_log_probs=[-0.1, -0.2]
        )


# ---------------------------------------------------------------- lenient input


def test_unknown_items_parts_tools_and_keys_round_trip() -> None:
    data = _result(
        [
            {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"query": "q"}},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_file", "file_url": "https://x/y.pdf"},
                    {"type": "input_text", "text": "t"},
                ],
                "x_custom": {"nested": [1, 2.5, None, "ü"]},
            },
        ],
        x_row_key="kept",
    )
    data["responses_create_params"]["tools"] = [{"type": "web_search", "filters": None}]
    parsed = p.parse_run_result(json.dumps(data).encode())
    assert p.dump(parsed) == data
    web, msg = parsed.response.output
    assert isinstance(web, p.UnknownItem) and web.model_extra == {
        "id": "ws_1",
        "status": "completed",
        "action": {"query": "q"},
    }
    assert isinstance(msg, p.InputMessage) and isinstance(msg.content, list)
    assert isinstance(msg.content[0], p.UnknownPart)
    assert isinstance(parsed.responses_create_params.tools[0], p.UnknownTool)


def test_known_type_with_bad_body_is_not_demoted_to_unknown() -> None:
    with pytest.raises(ProtocolError) as info:
        p.parse_items(
            json.dumps([{"type": "function_call", "call_id": "c", "name": "n", "arguments": {"x": 1}}])
        )
    message = str(info.value)
    assert "arguments" in message and "valid string" in message
    assert "tagged-union" not in message and "modelled" not in message
    with pytest.raises(ProtocolError, match="image_url"):
        p.parse_content_parts(json.dumps([{"type": "input_image", "image_url": 5}]))


def test_untyped_message_stays_untyped_and_untyped_other_is_refused() -> None:
    items = p.parse_items(b'[{"role": "user", "content": "hi"}]')
    assert isinstance(items[0], p.InputMessage)
    assert p.dump(items) == [{"role": "user", "content": "hi"}]
    with pytest.raises(ProtocolError):
        p.parse_items(b'[{"call_id": "c", "output": "x"}]')


def test_bad_role_is_refused() -> None:
    with pytest.raises(ProtocolError, match="robot"):
        p.parse_items(b'[{"type": "message", "role": "robot", "content": "x"}]')


def test_extra_keys_in_parsed_create_params_are_kept_and_reported() -> None:
    params = p.parse_responses_create_params(b'{"input": "hi", "my_key": 1}')
    assert params.non_gym_keys == ["my_key"]
    assert p.dump(params) == {"input": "hi", "my_key": 1}


def test_parse_errors_are_protocol_errors() -> None:
    for bad in [b"{not json", b"[1, 2]", b'{"responses_create_params": {}}', b""]:
        with pytest.raises(ProtocolError) as info:
            p.parse_run_request(bad)
        assert isinstance(info.value, GymbridgeError)
        assert str(info.value).startswith("invalid RunRequest body:")
    with pytest.raises(TypeError):
        p.parse_run_request(42)  # type: ignore[arg-type]


def test_null_tool_choice_from_older_dumps_is_accepted() -> None:
    params = p.parse_responses_create_params(
        b'{"input": "x", "tool_choice": null, "parallel_tool_calls": null}'
    )
    assert params.tool_choice is None and p.dump(params)["parallel_tool_calls"] is None


# ---------------------------------------------------------------- strict output


def test_built_items_write_every_field_gym_needs() -> None:
    assert p.FunctionCallItem(call_id="c", name="n", arguments="{}").to_dict() == {
        "type": "function_call",
        "call_id": "c",
        "name": "n",
        "arguments": "{}",
    }
    assert p.InputImagePart(image_url="data:image/png;base64,AA==").to_dict() == {
        "type": "input_image",
        "image_url": "data:image/png;base64,AA==",
        "detail": "auto",
    }
    assert p.OutputTextPart(text="t").to_dict() == {"type": "output_text", "text": "t", "annotations": []}
    msg = p.AssistantMessage(content=[p.OutputTextPart(text="t")]).to_dict()
    assert msg["id"].startswith("msg_") and msg["status"] == "completed" and msg["role"] == "assistant"
    assert p.ReasoningItem(summary=[p.SummaryTextPart(text="s")]).to_dict()["id"].startswith("rs_")
    assert p.InputMessage(role="user", content="x").to_dict() == {
        "type": "message",
        "role": "user",
        "content": "x",
    }
    assert p.FunctionTool(name="click").to_dict() == {
        "type": "function",
        "name": "click",
        "parameters": None,
        "strict": None,
    }


def test_built_response_is_complete_and_needs_a_model() -> None:
    with pytest.raises(ValidationError, match="model is required"):
        p.Response(output=[])
    resp = p.Response(model="m", output=[p.AssistantMessage(content="hi")]).to_dict()
    assert resp["id"].startswith("resp_") and isinstance(resp["created_at"], float)
    assert resp["object"] == "response" and resp["tools"] == [] and resp["tool_choice"] == "auto"
    assert resp["output"][0]["type"] == "message"


def test_built_create_params_refuse_keys_gym_would_422() -> None:
    with pytest.raises(ValidationError, match=r"'my_key'.*HTTP 422"):
        p.ResponsesCreateParams(input="x", my_key=1)


def test_built_row_writes_wire_aliases() -> None:
    row = p.RunRequest(
        responses_create_params=p.ResponsesCreateParams(input="x"),
        task_index=4,
        rollout_index=2,
    )
    assert row.to_dict() == {
        "responses_create_params": {"input": "x"},
        "_ng_task_index": 4,
        "_ng_rollout_index": 2,
    }
    assert p.parse_run_request(p.dump_json(row)).task_index == 4


def test_built_step_response_writes_the_stock_shape() -> None:
    step = p.StepResponse(observation="o", observation_content=[p.InputTextPart(text="o")])
    assert step.to_dict() == {
        "observation": "o",
        "reward": 0.0,
        "terminated": False,
        "truncated": False,
        "info": {},
        "observation_content": [{"type": "input_text", "text": "o"}],
    }


def test_built_verify_response_writes_mask_sample() -> None:
    resp = p.VerifyResponse(
        responses_create_params=p.ResponsesCreateParams(input="x"),
        response=p.Response(model="m", output=[]),
        reward=0.5,
    )
    assert resp.to_dict()["mask_sample"] is False


# ---------------------------------------------------------------- media parts and helpers


def test_media_part_sources() -> None:
    audio = p.InputAudioPart(input_audio=p.InputAudio(data="UklGRg==", format="wav"))
    assert audio.source == "data:audio/wav;base64,UklGRg=="
    assert p.InputAudioPart(audio_url="file:///a.flac").source == "file:///a.flac"
    video = p.parse_content_parts(
        b'[{"type": "input_video", "video_url": {"url": "file:///v.mp4", "fps": 2}}]'
    )[0]
    assert isinstance(video, p.InputVideoPart) and video.source == "file:///v.mp4"
    assert p.dump([video]) == [{"type": "input_video", "video_url": {"url": "file:///v.mp4", "fps": 2}}]
    with pytest.raises(ProtocolError, match="exactly one of video_url or video"):
        p.parse_content_parts(b'[{"type": "input_video", "video_url": "a", "video": "b"}]')
    with pytest.raises(ProtocolError, match="non-empty URL"):
        p.parse_content_parts(b'[{"type": "input_video", "video": " "}]')
    with pytest.raises(ProtocolError, match="exactly one of input_audio or audio_url"):
        p.parse_content_parts(b'[{"type": "input_audio"}]')


def test_function_call_output_with_image_parts() -> None:
    (item,) = p.parse_items(
        json.dumps(
            [
                {
                    "type": "function_call_output",
                    "call_id": "c",
                    "output": [
                        {"type": "input_image", "image_url": "data:image/png;base64,AA==", "detail": "high"}
                    ],
                }
            ]
        )
    )
    assert isinstance(item, p.FunctionCallOutputItem) and isinstance(item.output, list)
    assert [part.source for part in p.iter_media_parts(item.output)] == ["data:image/png;base64,AA=="]


def test_string_input_becomes_one_user_message() -> None:
    params = p.parse_responses_create_params(b'{"input": "hello"}')
    (msg,) = params.input_items
    assert isinstance(msg, p.InputMessage) and msg.role == "user" and msg.text == "hello"
    assert p.dump(params) == {"input": "hello"}  # the wire form is untouched


def test_incomplete_response_from_simple_agent() -> None:
    resp = p.parse_response(
        json.dumps(
            {
                "id": "r",
                "status": "incomplete",
                "metadata": {"ng_termination_reason": "incomplete_reasoning"},
                "output": [
                    {"type": "reasoning", "id": "rs", "summary": [{"type": "summary_text", "text": "hm"}]}
                ],
            }
        )
    )
    assert resp.incomplete and resp.output_text == ""
    assert resp.generated_items[0].text == "hm"  # type: ignore[union-attr]


def test_aggregate_metrics_bodies() -> None:
    request = p.parse_aggregate_metrics_request(
        b'{"verify_responses": [{"_ng_task_index": 0, "reward": 1.0}]}'
    )
    assert request.verify_responses[0]["reward"] == 1.0
    metrics = p.parse_aggregate_metrics(b'{"agent_metrics": {"mean/reward": 0.5}, "key_metrics": {}}')
    assert metrics.agent_metrics["mean/reward"] == 0.5 and metrics.group_level_metrics == []
    assert p.dump(metrics) == {"agent_metrics": {"mean/reward": 0.5}, "key_metrics": {}}


def test_row_key_named_like_a_field_is_kept_verbatim() -> None:
    """Regression: a dataset column ``task_index`` was read as ``_ng_task_index`` and renamed on dump."""
    data = {
        "responses_create_params": {"input": "x"},
        "task_index": 7,
        "rollout_id": "r",
        "_ng_rollout_index": 2,
    }
    for raw in (json.dumps(data).encode(), data):
        row = p.parse_run_request(raw)
        assert row.task_index is None and row.rollout_index == 2
        assert row.model_extra == {"task_index": 7, "rollout_id": "r"}
        assert p.dump(row) == data


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ([{"call_id": "x"}], "input.0.type: Field required"),
        (
            [{"role": "user", "content": [{"type": "input_image", "image_url": "d", "detail": 3}]}],
            "input.0.user.content.0.input_image.detail: Input should be a valid string",
        ),
        ([{"type": "zz", "prompt_token_ids": [1]}], "input.0: Value error, token fields must come together"),
        ([{"type": "message", "role": "bot", "content": "x"}], "Input tag 'bot' found using 'role'"),
    ],
)
def test_error_message_points_at_the_real_problem(body: list[Any], expected: str) -> None:
    with pytest.raises(ProtocolError) as info:
        p.parse_run_request(json.dumps({"responses_create_params": {"input": body}}))
    message = str(info.value)
    assert expected in message
    # no union-dispatch noise: branch labels, the str branch of ``str | list``, "type is modelled"
    assert "tagged-union" not in message and "function-after" not in message
    assert "input.str" not in message and "modelled" not in message


# ---------------------------------------------------------------- transitions form


def _transitions_result(second_step_item: dict[str, Any]) -> dict[str, Any]:
    first = [{"type": "message", "role": "user", "content": "go"}, _call(**TOKENS)]
    return _result([first, [*first, second_step_item]], contains_transitions=True)


def test_regression_transitions_form_output_round_trips() -> None:
    """aviary_agent / toolsandbox_agent (return_transitions) send response.output as one item
    list per step; parsing refused it with 'Input should be an object'."""
    body = _transitions_result({"type": "function_call_output", "call_id": "c1", "output": "ok"})
    body["response"]["contains_transitions"] = True
    parsed = p.parse_run_result(json.dumps(body))
    assert p.dump(parsed) == body
    assert parsed.response.is_transitions
    assert [type(i).__name__ for i in parsed.response.items] == [
        "InputMessage",
        "FunctionCallItem",
        "FunctionCallOutputItem",
    ]
    flat = p.parse_run_result(json.dumps(_result([_call(**TOKENS)])))
    assert not flat.response.is_transitions
    assert flat.response.items == flat.response.output


def test_transitions_form_errors_name_the_step_and_item_only() -> None:
    body = _transitions_result(_call(prompt_token_ids=[1]))
    with pytest.raises(ProtocolError) as info:
        p.parse_run_result(json.dumps(body))
    message = str(info.value)
    assert "response.output.1.2" in message and "missing generation_token_ids" in message
    assert "Input should be an object" not in message  # the flat-list branch's noise is gone
    first = info.value.errors[0]
    assert isinstance(first, dict) and first["loc"][:4] == ("response", "output", 1, 2)


def test_bad_typed_message_is_reported_once_not_once_per_union_branch() -> None:
    """A typed message failed in the typed branch and again in the untyped-message branch: the
    error listed the same problem twice under two locations."""
    bad = {"type": "message", "role": "assistant", "content": None, **TOKENS}
    with pytest.raises(ProtocolError) as info:
        p.parse_run_result(json.dumps(_result([bad])))
    message = str(info.value)
    assert message == "invalid RunResult body: response.output.0.message.assistant.content: " + (
        "Input should be a valid array"
    )
    assert len(info.value.errors) == 1
