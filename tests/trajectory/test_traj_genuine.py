"""Genuine NeMo Gym 0.7.0 result shapes through ``from_gym_result``: what the stock agents emit.

Regression tests for shapes the first version choked on (transitions-form output from
``aviary_agent`` / ``toolsandbox_agent``, all-empty generations from hermes-style
agents), plus genuine example rollouts from the nemo-gym 0.7.0 wheel in the conformance venv
(the ``gym_wheel_data`` fixture: skipped with the reason when absent, a failure in CI).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from traj_helpers import call, call_output, image_part, png_url, result, tok, user_msg

from gymbridge import protocol as p
from gymbridge.errors import TrajectoryError
from gymbridge.trajectory import from_gym_result

RED, GREEN, BLUE = png_url((200, 0, 0)), png_url((0, 200, 0)), png_url((0, 0, 200))


def _genuine_lines(src: Path, rel: str, n: int = 3) -> list[bytes]:
    path = src / rel
    assert path.is_file(), f"{rel} is not in the nemo-gym 0.7.0 wheel"
    with path.open("rb") as fh:
        return [line for _, line in zip(range(n), fh, strict=False)]


def _transitions(*steps: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Cumulative agent inputs, as aviary_agent builds them: step t = step t-1 + new items."""
    out: list[list[dict[str, Any]]] = []
    for new in steps:
        out.append([*(out[-1] if out else []), *new])
    return out


def _aviary_like() -> dict[str, Any]:
    steps = _transitions(
        [user_msg([image_part(RED)]), call("look", "c0", **tok([1, 2], [3])), call_output(GREEN, "c0")],
        [call("look", "c1", **tok([1, 2, 3, 4], [5])), call_output([image_part(BLUE)], "c1")],
        [{**call("done", "c2", **tok([1, 2, 3, 4, 5, 6], [7]))}],
    )
    res = result([], input_items=[])
    res["response"]["output"] = steps
    res["response"]["contains_transitions"] = True
    return res


def test_regression_transitions_form_output_is_walked_as_one_conversation() -> None:
    """aviary_agent/toolsandbox_agent with return_transitions put one item list per step in
    response.output; the walk refused it ('not an object') and the protocol could not parse it."""
    res = _aviary_like()
    traj = from_gym_result(res)
    assert [t.tool_name for t in traj.turns] == ["look", "look", "done"]
    assert [[m.source for m in t.media] for t in traj.turns] == [[RED], [GREEN], [BLUE]]
    assert traj.token_ids() == [1, 2, 3, 4, 5, 6, 7]
    assert traj.loss_mask() == [0, 0, 1, 0, 1, 0, 1]
    # the protocol keeps the form and gives the flat conversation
    parsed = p.parse_run_result(json.dumps(res))
    assert p.dump(parsed) == res
    assert parsed.response.is_transitions
    assert len(parsed.response.items) == 6
    assert [type(i).__name__ for i in parsed.response.generated_items] == ["FunctionCallItem"] * 3
    assert from_gym_result(parsed).token_ids() == traj.token_ids()


def test_transitions_with_collapsed_old_observation_keep_its_media() -> None:
    """aviary's collapse_old_env_states replaces an old observation by a text stand-in in later
    steps; its image must still belong to the turn after it, counted once."""
    res = _aviary_like()
    later = res["response"]["output"][1:]
    for step in later:
        step[0] = user_msg("[previous environment state hidden]")
    traj = from_gym_result(res)
    assert [[m.source for m in t.media] for t in traj.turns] == [[RED], [GREEN], [BLUE]]


def test_transitions_that_repeat_the_initial_input_count_its_media_once() -> None:
    first = user_msg([image_part(RED)])
    res = result([], input_items=[first])
    res["response"]["output"] = _transitions([first, call("look", "c0", **tok([1], [2]))])
    traj = from_gym_result(res)
    assert [m.source for m in traj.turns[0].media] == [RED]


def test_transitions_that_shrink_are_refused_naming_the_step() -> None:
    res = _aviary_like()
    res["response"]["output"][2] = res["response"]["output"][2][:2]
    with pytest.raises(TrajectoryError, match=r"response.output\[2\] \(transitions form\) has 2 items"):
        from_gym_result(res)


def test_transitions_error_names_the_step_and_position() -> None:
    res = _aviary_like()
    bad = res["response"]["output"][1][3]
    bad["generation_log_probs"] = [float("nan")]
    with pytest.raises(TrajectoryError) as info:
        from_gym_result(res)
    assert info.value.item_index == 3
    assert "not finite" in str(info.value)
    assert "response.output[1][3], transitions form" in str(info.value)


def test_mixed_items_and_transition_lists_are_refused() -> None:
    res = _aviary_like()
    res["response"]["output"].append(call("x", "c9", **tok([1], [2])))
    with pytest.raises(TrajectoryError, match="mixes items and transition lists"):
        from_gym_result(res)


def test_regression_all_empty_generations_say_so() -> None:
    """hermes-style agents attach token fields with empty lists to every item; the error only
    listed generic causes, not that token fields were there but empty."""
    empty = tok([], [])
    res = result([{**call("run", "c0"), **empty}, call_output("ok", "c0")])
    with pytest.raises(TrajectoryError, match=r"1 item\(s\) carry token fields but every generation"):
        from_gym_result(res)
    no_tokens = result([call("run", "c0"), call_output("ok", "c0")])
    with pytest.raises(TrajectoryError, match="none carries token fields"):
        from_gym_result(no_tokens)


@pytest.mark.parametrize(
    "rel",
    [
        "resources_servers/competitive_coding_challenges/data/example_rollouts.jsonl",
        "benchmarks/automationbench/data/example_rollouts.jsonl",
    ],
)
def test_genuine_rollouts_with_token_fields_give_trajectories(rel: str, gym_wheel_data: Path) -> None:
    for line in _genuine_lines(gym_wheel_data, rel):
        raw = json.loads(line)
        traj = from_gym_result(line)
        assert traj.turns, rel
        last = raw["response"]["output"][traj.turns[-1].item_index]
        assert traj.turns[-1].generation_token_ids == last["generation_token_ids"]
        # the first turn's prompt is its full prompt; the views stay aligned
        assert (
            traj.turns[0].prompt_token_ids
            == raw["response"]["output"][traj.turns[0].item_index]["prompt_token_ids"]
        )
        assert len(traj.token_ids()) == len(traj.loss_mask()) == len(traj.logprobs())
        assert traj.reward == raw["reward"]
        # the wire model gives the same trajectory as the raw dict
        assert from_gym_result(p.parse_run_result(line)).token_ids() == traj.token_ids()


def test_genuine_hermes_rollout_with_only_empty_generations_is_a_clear_error(gym_wheel_data: Path) -> None:
    (line,) = _genuine_lines(gym_wheel_data, "environments/hermes_math/data/example_rollouts.jsonl", 1)
    with pytest.raises(TrajectoryError, match="every generation_token_ids is empty"):
        from_gym_result(line)


def test_genuine_aviary_transitions_rollouts_walk(gym_wheel_data: Path) -> None:
    """Genuine aviary rollouts (transitions form, no token fields): parsed losslessly and
    refused by the walk for the right reason, not for their shape."""
    for line in _genuine_lines(gym_wheel_data, "environments/aviary_bixbench/data/example_rollouts.jsonl"):
        raw = json.loads(line)
        parsed = p.parse_run_result(line)
        assert parsed.response.is_transitions
        assert p.dump(parsed) == raw
        with pytest.raises(TrajectoryError, match="none carries token fields"):
            from_gym_result(raw)


def test_message_with_another_non_assistant_role_is_context_not_assistant_output() -> None:
    """A chat-style ``tool`` message injected by an agent: its image belongs to the next turn,
    and it is not counted as untrained assistant output."""
    out = [
        call("look", "c0", **tok([1], [2])),
        {"type": "message", "role": "tool", "content": [image_part(GREEN)]},
        call("done", "c1", **tok([1, 2, 3], [4])),
    ]
    traj = from_gym_result(result(out))
    assert [[m.source for m in t.media] for t in traj.turns] == [[], [GREEN]]
    assert "trailing_assistant_items" not in traj.metadata


def test_images_moved_to_media_assets_are_refused_not_silently_dropped() -> None:
    """0.7.0's simple_agent_with_compaction strips image parts from response.output and keeps
    them in response.media_assets: walking it would give turns with placeholders but no images."""
    res = result([call("look", "c0", **tok([1], [2]))])
    res["response"]["media_assets"] = {"m1": {"media_id": "m1", "source_part": image_part(RED)}}
    with pytest.raises(TrajectoryError, match=r"media_assets holds 1 media item"):
        from_gym_result(res)
    res["response"]["media_assets"] = {}  # a text-only compaction rollout is fine
    assert len(from_gym_result(res).turns) == 1
