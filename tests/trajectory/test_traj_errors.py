"""Every way a Gym result can be untrainable raises TrajectoryError naming the item and the reason."""

from __future__ import annotations

import math
from typing import Any

import pytest
from traj_helpers import assistant, call_output, image_part, reasoning_item, result, tok, user_msg

from gymbridge.errors import MediaError, MediaPolicyError, TrajectoryError
from gymbridge.trajectory import from_gym_result


def _raises(res: Any, match: str, item_index: int | None, **kwargs: Any) -> TrajectoryError:
    with pytest.raises(TrajectoryError, match=match) as info:
        from_gym_result(res, **kwargs)
    assert info.value.item_index == item_index
    return info.value


@pytest.mark.parametrize(
    "output",
    [
        pytest.param([], id="empty-output"),
        pytest.param([assistant("hello")], id="no-token-fields"),
        pytest.param([reasoning_item("hmm"), assistant("", **tok([1, 2], []))], id="empty-generation-only"),
    ],
)
def test_no_trainable_item_names_likely_causes(output: list[dict[str, Any]]) -> None:
    err = _raises(result(output), "no trainable item", None)
    assert "context limit" in str(err) and "reasoning-only" in str(err)


def test_logprob_length_mismatch() -> None:
    out = [
        assistant("a", **tok([1], [5, 6])),
        call_output("x"),
        assistant("b", **tok([1, 5, 6, 7], [8], [-0.1, -0.2])),
    ]
    _raises(result(out), "1 generated tokens", 2)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_logprob(bad: float) -> None:
    out = [assistant("a", **tok([1], [5, 6, 7], [-0.1, bad, -0.3]))]
    err = _raises(result(out), r"generation_log_probs\[1\]", 0)
    assert "not finite" in str(err)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_reward(bad: float) -> None:
    _raises(result([assistant("a", **tok([1], [2]))], reward=bad), "reward is", None)


def test_missing_reward() -> None:
    res = result([assistant("a", **tok([1], [2]))])
    del res["reward"]
    _raises(res, "no 'reward'", None)


@pytest.mark.parametrize("missing", ["prompt_token_ids", "generation_token_ids", "generation_log_probs"])
def test_token_fields_partly_present(missing: str) -> None:
    item = assistant("a", **tok([1], [2]))
    del item[missing]
    err = _raises(result([call_output("x"), item]), "partly present", 1)
    assert missing in str(err)


def test_non_int_token_ids() -> None:
    _raises(result([assistant("a", **tok([1, "2"], [3]))]), "only ints", 0)  # type: ignore[list-item]
    _raises(result([assistant("a", **tok([1], [3.5]))]), "only ints", 0)  # type: ignore[list-item]
    _raises(result([assistant("a", **tok([1], [-3]))]), "negative", 0)


def test_noncontiguous_prompt_error_names_item_and_position() -> None:
    out = [
        assistant("a", **tok([1, 2, 3], [4, 5])),
        user_msg("more"),
        assistant("b", **tok([1, 2, 9, 4, 5, 6], [7])),
    ]
    err = _raises(result(out), "first difference at token 2", 2)
    assert "segment 0" in str(err)


def test_noncontiguous_shorter_prompt() -> None:
    out = [assistant("a", **tok([1, 2, 3], [4, 5])), assistant("b", **tok([1, 2], [7]))]
    _raises(result(out), "shorter than the history", 1)


def test_media_refused_by_policy_in_output_chains_the_media_error() -> None:
    out = [
        assistant("a", **tok([1], [2])),
        user_msg([image_part("file:///etc/secret.png")]),
        assistant("b", **tok([1, 2, 3], [4])),
    ]
    err = _raises(result(out), "refused", 1)
    assert isinstance(err.__cause__, MediaPolicyError)


def test_media_refused_in_initial_input_names_the_location() -> None:
    res = result([assistant("a", **tok([1], [2]))], input_items=[user_msg([image_part("ftp://x/y.png")])])
    err = _raises(res, r"responses_create_params\.input\[0\]", None)
    assert isinstance(err.__cause__, MediaError)


def test_media_part_without_reference() -> None:
    out = [
        assistant("a", **tok([1], [2])),
        call_output([{"type": "input_image", "detail": "auto"}]),
        assistant("b", **tok([1, 2, 3], [4])),
    ]
    _raises(result(out), "input_image part has none of image_url", 1)


def test_media_part_with_file_id_is_refused_not_dropped() -> None:
    out = [user_msg([{"type": "input_image", "file_id": "file-123"}]), assistant("a", **tok([1], [2]))]
    _raises(result(out), "file_id", 0)


def test_generated_tokens_on_a_user_message() -> None:
    out = [user_msg("simulated user") | tok([1], [2])]
    _raises(result(out), "only assistant", 0)


@pytest.mark.parametrize(
    ("components", "ok"),
    [({"a": 0.5, "b": 0.5}, True), ({"a": 0.5, "b": 0.5 + 5e-7}, True), ({"a": 0.5, "b": 0.4}, False)],
)
def test_reward_components_must_sum_to_reward_under_the_sum_check(
    components: dict[str, float], ok: bool
) -> None:
    res = result([assistant("a", **tok([1], [2]))], reward_components=components)
    if ok:
        assert from_gym_result(res, reward_components_check="sum").reward_components == components
    else:
        _raises(res, "reward_components sum to", None, reward_components_check="sum")
    # the default keeps them as given either way
    assert from_gym_result(res).reward_components == components


def test_non_finite_reward_component() -> None:
    res = result([assistant("a", **tok([1], [2]))], reward_components={"a": math.nan, "b": 1.0})
    _raises(res, "not finite", None)


def test_bad_json_and_wrong_shapes() -> None:
    _raises(b"{not json", "not valid JSON", None)
    _raises("[1, 2]", "not an object", None)
    _raises({"reward": 1.0}, "no 'response'", None)
    _raises({"response": {"output": None}, "reward": 1.0}, "not a list", None)
    _raises(result([assistant("a", **tok([1], [2])), "junk"]), "not an object", 1)  # type: ignore[list-item]


def test_programming_mistakes_stay_builtin() -> None:
    with pytest.raises(TypeError):
        from_gym_result(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="on_noncontiguous"):
        from_gym_result(result([assistant("a", **tok([1], [2]))]), on_noncontiguous="drop")  # type: ignore[arg-type]


def test_media_without_placeholders_is_an_error_not_a_silent_attach() -> None:
    image = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo=", "detail": "auto"}
    out = [
        assistant("a", **tok([1, 9, 9, 2], [3])),  # one image run (9 9) for the initial image: fine
        user_msg([image]),
        assistant("b", **tok([1, 9, 9, 2, 3, 4], [5])),  # an image arrived, but no placeholder
    ]
    res = result(out, input_items=[user_msg([image])])
    from_gym_result(res)  # without placeholder ids the walk cannot know
    err = _raises(res, "1 image item", 2, placeholder_token_ids={"image": 9})
    assert "0 image placeholder" in str(err)
