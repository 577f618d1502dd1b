"""Golden Gym results (NeMo Gym 0.7.0 shapes) -> the trajectories they must give."""

from __future__ import annotations

import json

import pytest
from traj_helpers import GOLDEN_NAMES, load_golden, summary

from gymbridge.errors import TrajectoryError
from gymbridge.media import MediaPolicy
from gymbridge.trajectory import Trajectory, from_gym_result

VIDEO_POLICY = MediaPolicy(allowed_local_roots=["/data/gymbridge-golden"])


def _parse(name: str, **kwargs: object) -> tuple[Trajectory, dict[str, object], object]:
    raw, expected = load_golden(name)
    policy = VIDEO_POLICY if name == "video_part" else None
    traj = from_gym_result(raw, media_policy=policy, **kwargs)  # type: ignore[arg-type]
    return traj, json.loads(raw), expected


def test_every_golden_is_covered() -> None:
    assert len(GOLDEN_NAMES) == 11


@pytest.mark.parametrize("name", [n for n in GOLDEN_NAMES if n != "non_appending_history"])
def test_golden(name: str) -> None:
    traj, result, expected = _parse(name)
    assert summary(traj, result) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("name", [n for n in GOLDEN_NAMES if n != "non_appending_history"])
def test_golden_token_views_rebuild_the_last_prompt(name: str) -> None:
    """token_ids(0) is the last turn's full prompt + its generation; loss mask and logprobs align."""
    traj, result, _ = _parse(name)
    output = result["response"]["output"]  # type: ignore[index]
    last = traj.turns[-1]
    item = output[last.item_index]
    assert traj.token_ids(0) == item["prompt_token_ids"] + item["generation_token_ids"]
    mask, logprobs = traj.loss_mask(0), traj.logprobs(0)
    assert len(mask) == len(logprobs) == len(traj.token_ids(0))
    assert sum(mask) == sum(len(t.generation_token_ids) for t in traj.turns)
    generated = [lp for lp, m in zip(logprobs, mask, strict=True) if m]
    assert generated == [lp for t in traj.turns for lp in t.generation_logprobs]
    assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if not m)


def test_non_appending_history_error_names_the_item() -> None:
    raw, expected = load_golden("non_appending_history")
    with pytest.raises(TrajectoryError, match="non-contiguous") as info:
        from_gym_result(raw)
    assert info.value.item_index == expected["error_item_index"]
    assert "on_noncontiguous='split'" in str(info.value)


def test_non_appending_history_split_gives_two_usable_segments() -> None:
    traj, result, expected = _parse("non_appending_history", on_noncontiguous="split")
    assert summary(traj, result) == expected["split"]  # type: ignore[index, arg-type]
    output = result["response"]["output"]  # type: ignore[index]
    # segment 1 starts from the full re-rendered prompt and keeps appending
    first, last = traj.segment_turns(1)[0], traj.segment_turns(1)[-1]
    assert first.prompt_token_ids == output[first.item_index]["prompt_token_ids"]
    assert traj.token_ids(1) == output[last.item_index]["prompt_token_ids"] + last.generation_token_ids
    # nothing dropped: every generated token of every turn is trained once
    assert sum(traj.loss_mask(0)) + sum(traj.loss_mask(1)) == sum(
        len(t.generation_token_ids) for t in traj.turns
    )
    assert [m.modality for m in traj.media(1)] == ["image", "image"]


def test_reasoning_only_golden_keeps_termination_reason() -> None:
    traj, _, _ = _parse("reasoning_only_turn")
    assert traj.truncated
    assert traj.metadata["termination_reason"] == "incomplete_reasoning"


def test_counter_golden_turns_are_deltas() -> None:
    traj, result, _ = _parse("stateful_counter_reasoning")
    output = result["response"]["output"]  # type: ignore[index]
    for prev, turn in zip(traj.turns, traj.turns[1:], strict=False):
        full = output[turn.item_index]["prompt_token_ids"]
        prev_item = output[prev.item_index]
        consumed = len(prev_item["prompt_token_ids"]) + len(prev_item["generation_token_ids"])
        assert turn.prompt_token_ids == full[consumed:]
    assert traj.turns[0].tool_names == ["increment_counter", "increment_counter"]


def test_video_golden_is_not_read() -> None:
    """The video file does not exist: postprocessing must not touch it (lazy reference)."""
    traj, _, _ = _parse("video_part")
    (video,) = traj.turns[0].media
    assert video.modality == "video"
    assert video.source.startswith("file:///data/gymbridge-golden/")


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_golden_through_the_wire_models(name: str) -> None:
    """Goldens are valid gymbridge.protocol RunResults, and the parsed model gives the same trajectory."""
    from gymbridge.protocol import parse_run_result

    raw, _ = load_golden(name)
    policy = VIDEO_POLICY if name == "video_part" else None
    from_model = from_gym_result(parse_run_result(raw), media_policy=policy, on_noncontiguous="split")
    from_bytes = from_gym_result(raw, media_policy=policy, on_noncontiguous="split")
    result = json.loads(raw)
    assert summary(from_model, result) == summary(from_bytes, result)
    assert from_model.token_ids(0) == from_bytes.token_ids(0)


# the placeholder ids make_goldens.py writes (Qwen2-VL's)
PLACEHOLDERS = {"image": 151655, "audio": 151646, "video": 151656}


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_golden_media_match_their_placeholder_tokens(name: str) -> None:
    raw, _ = load_golden(name)
    policy = VIDEO_POLICY if name == "video_part" else None
    traj = from_gym_result(
        raw, media_policy=policy, on_noncontiguous="split", placeholder_token_ids=PLACEHOLDERS
    )
    assert traj.turns


def test_empty_generation_golden_records_the_trailing_call() -> None:
    traj, _, _ = _parse("empty_generation")
    assert traj.metadata["trailing_assistant_items"] == 1
    assert traj.metadata["termination_reason"] == "empty_output"
