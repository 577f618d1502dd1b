"""Flags, outcome fields and input forms of from_gym_result; the public API surface."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict
from traj_helpers import (
    assistant,
    call,
    call_output,
    image_part,
    load_golden,
    png_url,
    reasoning_item,
    result,
    tok,
    user_msg,
)

import gymbridge.trajectory as trajectory_pkg
from gymbridge.errors import TrajectoryError
from gymbridge.trajectory import from_gym_result

RED = png_url((200, 0, 0))


def test_public_api_is_complete() -> None:
    names = trajectory_pkg.__all__
    assert len(names) == len(set(names))
    for required in ("from_gym_result", "Trajectory", "Turn", "build_generation_input", "GenerationInput"):
        assert required in names
        assert getattr(trajectory_pkg, required) is not None


def test_invalid_tool_call_flag_for_markup_left_in_text() -> None:
    text = '<tool_call>\n{"name": "click", "arguments": {"x": 1}}\n</tool_call>'
    out = [assistant(text, **tok([1], [2])), user_msg("?"), assistant("fine", **tok([1, 2, 3], [4]))]
    traj = from_gym_result(result(out))
    assert [t.invalid_tool_call for t in traj.turns] == [True, False]
    assert not any(t.malformed_thinking for t in traj.turns)


def test_malformed_thinking_flag_for_think_tags_in_an_answer() -> None:
    out = [
        assistant("<think>hmm</think> The answer is 4.", **tok([1], [2])),
        user_msg("?"),
        assistant("the answer</think> is 5", **tok([1, 2, 3], [4])),
        user_msg("?"),
        reasoning_item("<think> in a reasoning summary is not an answer", **tok([1, 2, 3, 4, 5], [6])),
    ]
    traj = from_gym_result(result(out))
    assert [t.malformed_thinking for t in traj.turns] == [True, True, False]


def test_flags_come_from_every_item_of_the_model_call() -> None:
    """Token fields sit on the call's last item; markup in an earlier message of that call still counts."""
    out = [assistant("<tool_call>{}</tool_call>"), call("f", **tok([1], [2]))]
    (turn,) = from_gym_result(result(out)).turns
    assert turn.kind == "function_call" and turn.tool_name == "f" and turn.invalid_tool_call


def test_tool_name_only_on_function_call_turns() -> None:
    out = [call("zoom", **tok([1], [2])), call_output("ok"), assistant("a", **tok([1, 2, 3], [4]))]
    traj = from_gym_result(result(out))
    assert [t.tool_name for t in traj.turns] == ["zoom", None]


@pytest.mark.parametrize(
    ("response_extra", "top_extra", "truncated"),
    [
        ({"incomplete_details": {"reason": "max_output_tokens"}, "status": "incomplete"}, {}, True),
        ({"status": "incomplete"}, {}, True),
        ({}, {"truncated": True}, True),  # gymnasium agent: max_steps reached
        ({"incomplete_details": None}, {"truncated": False}, False),
    ],
)
def test_truncated(response_extra: dict[str, Any], top_extra: dict[str, Any], truncated: bool) -> None:
    res = result([assistant("a", **tok([1], [2]))], **top_extra)
    res["response"].update(response_extra)
    traj = from_gym_result(res)
    assert traj.truncated is truncated
    if response_extra.get("incomplete_details"):
        assert traj.metadata["incomplete_reason"] == "max_output_tokens"


def test_outcome_fields_from_the_070_top_level() -> None:
    res = result(
        [assistant("a", **tok([1], [2]))],
        reward=0.0,
        mask_sample=True,
        failure_kind="env_timeout",
        failure_reason="reset took 30 s",
        _ng_task_index=12,
        _ng_rollout_index=3,
    )
    traj = from_gym_result(res)
    assert (traj.mask_sample, traj.failure_class, traj.failure_reason) == (
        True,
        "env_timeout",
        "reset took 30 s",
    )
    assert (traj.task_index, traj.rollout_index, traj.reward) == (12, 3, 0.0)
    assert traj.metadata["response_id"] == "resp_1"


def test_unknown_items_pass_through_and_media_after_the_last_turn_is_counted() -> None:
    out = [
        {"type": "mcp_list_tools", "id": "m", "server_label": "s", "tools": []},
        {"type": "web_search_call", "id": "w", "status": "completed"},
        assistant("a", **tok([1], [2])),
        call_output(RED),
    ]
    traj = from_gym_result(result(out))
    assert len(traj.turns) == 1
    assert traj.metadata["trailing_media"] == 1


def test_seed_obs_echoed_at_the_start_of_output_is_counted_once() -> None:
    seed = [user_msg([image_part(RED)])]
    res = result([*seed, assistant("a", **tok([1], [2]))])
    res["response"]["seed_obs"] = seed
    (turn,) = from_gym_result(res).turns
    assert [m.source for m in turn.media] == [RED]


def test_accepts_dict_bytes_str_and_pydantic_model() -> None:
    raw, expected = load_golden("function_call_image_output_list")
    as_dict = json.loads(raw)

    class RunResult(BaseModel):
        model_config = ConfigDict(extra="allow")
        reward: float

    model = RunResult.model_validate(as_dict)
    trajectories = [from_gym_result(x) for x in (raw, raw.decode(), as_dict, model, bytearray(raw))]
    summaries = [[(t.kind, [m.key for m in t.media]) for t in traj.turns] for traj in trajectories]
    assert all(s == summaries[0] for s in summaries)
    assert [[m["key"] for m in t["media"]] for t in expected["turns"]] == [
        [k for k in keys] for _, keys in summaries[0]
    ]


def test_none_token_fields_from_a_model_dump_mean_absent() -> None:
    """Wire models dump unset token fields as null: those items are context, not half-tokened turns."""
    nulls = {"prompt_token_ids": None, "generation_token_ids": None, "generation_log_probs": None}
    out = [reasoning_item("pre") | nulls, assistant("a", **tok([1], [2]))]
    assert len(from_gym_result(result(out)).turns) == 1


def test_postprocessing_does_not_read_media_bytes() -> None:
    """No fetch, no decode: http URLs are parsed and policy-checked only; items stay lazy."""
    video = {"type": "input_video", "video_url": {"url": "https://example.invalid/v.mp4"}}
    out = [user_msg([image_part(RED), video]), assistant("a", **tok([1], [2]))]
    (turn,) = from_gym_result(result(out)).turns  # an unresolvable host: fetching would fail
    assert [m.modality for m in turn.media] == ["image", "video"]
    assert not any(m.loaded for m in turn.media)
    out[0]["content"] = [{"type": "input_video", "video_url": "http://127.0.0.1/v.mp4"}]
    with pytest.raises(TrajectoryError, match="loopback") as info:
        from_gym_result(result(out))  # but the policy check does happen here
    assert info.value.item_index == 0


def test_turns_do_not_alias_the_callers_result() -> None:
    res = result([assistant("a", **tok([1, 2], [3, 4]))])
    (turn,) = from_gym_result(res).turns
    item = res["response"]["output"][0]
    item["prompt_token_ids"].append(99)
    item["generation_token_ids"][0] = 77
    item["generation_log_probs"][0] = 0.0
    assert (turn.prompt_token_ids, turn.generation_token_ids, turn.generation_logprobs) == (
        [1, 2],
        [3, 4],
        [-0.5, -0.5],
    )
