"""One test per bug this field has shipped, named after the bug."""

from __future__ import annotations

import pytest
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

from gymbridge.trajectory import ConversationHistory, build_generation_input, from_gym_result

RED, GREEN, BLUE, GREY = (
    png_url((200, 0, 0)),
    png_url((0, 200, 0)),
    png_url((0, 0, 200)),
    png_url((90, 90, 90)),
)


def _sources(turn_media: list[object]) -> list[str]:
    return [m.source for m in turn_media]  # type: ignore[attr-defined]


def test_regression_role_gated_flush_shifts_images_after_reasoning_only_and_function_call_turns() -> None:
    """Flushing pending media only at assistant *message* items gave the tool images of a
    reasoning-only or function_call turn to the next message turn: every image one turn late."""
    out = [
        call("look", "c0", **tok([1, 2], [3])),  # turn 0: function_call
        call_output(GREEN, "c0"),  # -> turn 1
        reasoning_item("thinking", **tok([1, 2, 3, 4], [5])),  # turn 1: reasoning-only
        user_msg([image_part(BLUE)]),  # -> turn 2
        call("look", "c1", **tok([1, 2, 3, 4, 5, 6], [7])),  # turn 2: function_call
        call_output([image_part(GREY)], "c1"),  # -> turn 3
        assistant("done", **tok([1, 2, 3, 4, 5, 6, 7, 8], [9])),  # turn 3: message
    ]
    traj = from_gym_result(result(out, input_items=[user_msg([image_part(RED)])]))
    assert [t.kind for t in traj.turns] == ["function_call", "reasoning", "function_call", "message"]
    assert [_sources(t.media) for t in traj.turns] == [[RED], [GREEN], [BLUE], [GREY]]


def test_regression_role_gated_flush_golden() -> None:
    raw, _ = load_golden("reasoning_only_turn")
    traj = from_gym_result(raw)
    assert traj.turns[1].kind == "reasoning"
    assert len(traj.turns[1].media) == 1  # the tool's screenshot, not left pending


@pytest.mark.parametrize("where", ["row_input", "agent_input", "seed_obs"])
def test_regression_first_turn_missing_the_initial_images(where: str) -> None:
    """Walking only response.output forgot the images of the initial prompt: turn 0 had none."""
    res = result([assistant("a red circle", **tok([1, 2], [3]))])
    if where == "row_input":
        res["responses_create_params"]["input"] = [user_msg([image_part(RED)])]
    elif where == "agent_input":
        res["response"]["agent_input"] = [user_msg([image_part(RED)])]
    else:
        res["response"]["seed_obs"] = [user_msg([image_part(RED)])]
    traj = from_gym_result(res)
    assert _sources(traj.turns[0].media) == [RED]


def test_regression_first_turn_images_with_system_prompt_and_audio_metadata() -> None:
    wav_url = "data:audio/wav;base64,UklGRiQAAABXQVZFZm10IBAAAAABAAEAgD4AAAB9AAACABAAZGF0YQAAAAA="
    res = result(
        [assistant("ok", **tok([1], [2])), user_msg("next"), assistant("ok", **tok([1, 2, 3], [4]))],
        input_items=[user_msg("be brief", role="system"), user_msg([image_part(RED)], role="developer")],
    )
    res["responses_create_params"]["metadata"] = {"audio_data": wav_url}
    traj = from_gym_result(res)
    assert [(m.modality, m.source) for m in traj.turns[0].media] == [("image", RED), ("audio", wav_url)]
    assert traj.turns[1].media == []


@pytest.mark.parametrize(
    "text",
    [
        "/tmp/screenshot.png",
        "results/plot.png",
        "file:///etc/passwd",
        "https://example.com/cat.png",
        '{"x": 3}',
        '{"image": "data:image/png;base64,iVBORw0KGgo="}',
        "data:text/plain;base64,aGVsbG8=",
        "",
    ],
)
def test_regression_text_tool_output_treated_as_a_file_path(text: str) -> None:
    """A text tool output was handed to the media loader as a path: it failed (or read a file).
    With the default policy every local path is refused, so treating it as media would raise."""
    out = [
        call("run", **tok([1], [2])),
        call_output(text),
        assistant("ok", **tok([1, 2, 3], [4])),
    ]
    traj = from_gym_result(result(out))
    assert [t.media for t in traj.turns] == [[], []]


def test_regression_text_tool_output_data_url_image_is_media() -> None:
    """The counterpart: a data URL of an image MIME *is* the tool's image."""
    out = [call("shot", **tok([1], [2])), call_output(GREEN), assistant("ok", **tok([1, 2, 3], [4]))]
    traj = from_gym_result(result(out))
    assert _sources(traj.turns[1].media) == [GREEN]


def test_regression_later_turns_generated_from_the_stale_turn0_prompt() -> None:
    """Native rollouts re-sent the turn-0 prompt (tokens and images) at every turn, so the model
    never saw its own actions or the tool's new screenshots."""
    out = [
        call("shot", "c0", **tok([1, 2], [3])),
        call_output(GREEN, "c0"),
        call("shot", "c1", **tok([1, 2, 3, 4], [5])),
        call_output(BLUE, "c1"),
        assistant("done", **tok([1, 2, 3, 4, 5, 6], [7])),
    ]
    traj = from_gym_result(result(out, input_items=[user_msg([image_part(RED)])]))
    first = build_generation_input(ConversationHistory.from_trajectory(traj, 0))
    last = build_generation_input(ConversationHistory.from_trajectory(traj, 2))
    assert first.prompt_token_ids == [1, 2]
    assert last.prompt_token_ids == [1, 2, 3, 4, 5, 6]
    assert [m.source for m in last.media] == [RED, GREEN, BLUE]
    assert [im.getpixel((2, 2)) for im in last.multi_modal_data["image"]] == [
        (200, 0, 0),
        (0, 200, 0),
        (0, 0, 200),
    ]
    assert last != first
