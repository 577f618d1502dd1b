"""Genuine NeMo Gym shapes that were refused or silently reduced, each a named regression.

vibench-style rewards (the mean, not the sum, of the components), MoE ``routed_experts``,
the compaction agent's full response (images kept + ``media_assets``), audio given as
``metadata.audio_path`` / ``audio_paths``, and content parts of unknown types that carry media.
"""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile
from traj_helpers import assistant, call, call_output, image_part, png_url, result, tok, user_msg

from gymbridge.errors import ProtocolError, TrajectoryError
from gymbridge.generation.chat import responses_to_messages
from gymbridge.media import MediaPolicy
from gymbridge.protocol import metadata_audio_refs
from gymbridge.trajectory import from_gym_result

RED, GREEN = png_url((200, 0, 0)), png_url((0, 200, 0))


# ----------------------------------------------------------------- reward components
def _with_tokens(raw: dict[str, Any]) -> dict[str, Any]:
    """A genuine rollout as a training-mode model server would have returned it: token fields on
    its last assistant message (the example files were recorded without them)."""
    out = raw["response"]["output"]
    last = max(
        i for i, item in enumerate(out) if item.get("type") == "message" and item.get("role") == "assistant"
    )
    out[last] = {**out[last], **tok([1, 2, 3], [4, 5])}
    return raw


def test_regression_vibench_reward_is_the_mean_of_its_components(gym_wheel_data: Path) -> None:
    """All five genuine vibench rollouts were refused: their components do not sum to the reward."""
    path = gym_wheel_data / "resources_servers/vibench/data/example_rollouts.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 5
    for raw in rows:
        components = raw["reward_components"]
        assert math.isclose(raw["reward"], sum(components.values()) / len(components))
        traj = from_gym_result(_with_tokens(raw))
        assert traj.reward == raw["reward"]
        assert traj.reward_components == components  # kept per trajectory
    assert any(not math.isclose(r["reward"], sum(r["reward_components"].values())) for r in rows)
    with pytest.raises(TrajectoryError, match="reward_components sum to"):
        from_gym_result(_with_tokens(rows[1]), reward_components_check="sum")


def test_reward_components_check_rejects_unknown_modes() -> None:
    with pytest.raises(ValueError, match="reward_components_check"):
        from_gym_result(result([assistant("a", **tok([1], [2]))]), reward_components_check="mean")  # type: ignore[arg-type]


# ----------------------------------------------------------------- routed experts
def _routes(n: int, base: int = 0) -> list[list[list[int]]]:
    """``n`` token rows of 2 layers x top-2 expert ids."""
    return [[[base + t, base + t + 1], [base + t + 2, base + t + 3]] for t in range(n)]


def test_regression_routed_experts_are_kept_per_turn() -> None:
    """routed_experts on model-call items (MoE router replay) were dropped by the walk."""
    first = {**call("look", "c0", **tok([1, 2], [3])), "routed_experts": _routes(3, 10)}
    # the second call's routes cover its whole prompt + generation: the turn keeps only its delta's
    second = {**assistant("done", **tok([1, 2, 3, 4], [5])), "routed_experts": _routes(5, 20)}
    traj = from_gym_result(result([first, call_output("ok", "c0"), second]))
    assert traj.turns[0].routed_experts == _routes(3, 10)
    assert traj.turns[1].routed_experts == _routes(5, 20)[3:]  # prompt delta [4] + generation [5]
    routes = traj.routed_experts()
    assert routes is not None and len(routes) == len(traj.token_ids()) == 5


def test_routed_experts_of_the_generation_only_pad_the_prompt_with_the_missing_sentinel() -> None:
    item = {**assistant("a", **tok([1, 2], [3, 4])), "routed_experts": _routes(2, 7)}
    (turn,) = from_gym_result(result([item])).turns
    assert turn.routed_experts == [[[-1, -1], [-1, -1]]] * 2 + _routes(2, 7)


def test_routed_experts_envelope_is_decoded() -> None:
    values = np.arange(3 * 2 * 2, dtype="<i2").reshape(3, 2, 2)
    envelope = f"nrlre1:int16:3x2x2:{base64.b64encode(values.tobytes()).decode()}"
    item = {**assistant("a", **tok([1, 2], [3])), "routed_experts": envelope}
    (turn,) = from_gym_result(result([item])).turns
    assert turn.routed_experts == values.tolist()


@pytest.mark.parametrize(
    ("routes", "match"),
    [
        ([[[1, 2]]] * 4, "has 4 token rows; expected 3"),
        ([[[1, 2]], [[1]]], r"routed_experts\[1\] has another"),
        ("nrlre1:int16:9x2x2:AAAA", "envelope holds 3 bytes"),
        ("gzip:xyz", "not an nrlre1"),
    ],
)
def test_bad_routed_experts_are_errors_not_dropped(routes: Any, match: str) -> None:
    item = {**assistant("a", **tok([1, 2], [3])), "routed_experts": routes}
    with pytest.raises(TrajectoryError, match=match) as info:
        from_gym_result(result([item]))
    assert info.value.item_index == 0


def test_routed_experts_reach_train_batch_rows() -> None:
    from gymbridge.tensors import TrainBatch

    with_routes = from_gym_result(
        result([{**assistant("a", **tok([1, 2], [3])), "routed_experts": _routes(3)}])
    )
    without = from_gym_result(result([assistant("b", **tok([1, 2], [3]))], reward_components={"x": 0.5}))
    batch = TrainBatch.from_trajectories([with_routes, without], None, group_size=2)
    routes = batch.metadata[0]["routed_experts"]
    assert routes.tolist() == _routes(3) and routes.shape == (3, 2, 2)
    assert "routed_experts" not in batch.metadata[1]
    assert batch.metadata[1]["reward_components"] == {"x": 0.5}
    assert batch.select([0]).metadata[0]["routed_experts"] is routes  # follows the row


# ----------------------------------------------------------------- compaction agent
def _compaction_result(*, transport: bool) -> dict[str, Any]:
    first_user = user_msg([image_part(RED)])
    observation = user_msg([image_part(GREEN)])
    output = [call("look", "c0", **tok([1, 2], [3])), call_output("ok", "c0"), observation]
    output.append(assistant("done", **tok([1, 2, 3, 4, 5], [6])))
    assets = {
        "m1": {"media_id": "m1", "content_digest": "d1", "source_part": image_part(RED)},
        "m2": {"media_id": "m2", "content_digest": "d2", "source_part": image_part(GREEN)},
    }
    res = result(output, input_items=[first_user])
    res["response"]["media_assets"] = assets
    if transport:  # build_transport_response: image parts stripped from output, no agent_input
        res["response"]["output"][2] = user_msg([])
        res["responses_create_params"]["input"] = [user_msg([])]
        res["response"]["model_call_metadata"] = []
    else:
        res["response"]["agent_input"] = [first_user]
        res["verification_skipped"] = True
    return res


def test_regression_compaction_full_response_with_media_assets_trains() -> None:
    """simple_agent_with_compaction with skip_verification keeps every image and lists them in
    media_assets; it was refused as if its images had been stripped."""
    traj = from_gym_result(_compaction_result(transport=False))
    assert [[m.source for m in t.media] for t in traj.turns] == [[RED], [GREEN]]


def test_compaction_transport_form_is_still_refused_naming_the_missing_images() -> None:
    with pytest.raises(TrajectoryError, match=r"media_assets holds 2 media item\(s\), 2 of them missing"):
        from_gym_result(_compaction_result(transport=True))


# ----------------------------------------------------------------- audio paths
def _wav(path: Path) -> Path:
    soundfile.write(path, np.zeros(1600, dtype=np.float32), 16000, format="WAV")
    return path


def _audio_result(metadata: dict[str, Any]) -> dict[str, Any]:
    res = result([assistant("two", **tok([1, 2], [3]))])
    res["responses_create_params"]["metadata"] = metadata
    return res


def test_regression_metadata_audio_path_is_read_under_the_media_policy(tmp_path: Path) -> None:
    """Genuine vllm_model reads metadata.audio_path / audio_paths; gymbridge dropped them."""
    a, b = _wav(tmp_path / "a.wav"), _wav(tmp_path / "b.wav")
    policy = MediaPolicy(allowed_local_roots=(tmp_path,))
    (turn,) = from_gym_result(_audio_result({"audio_path": str(a)}), media_policy=policy).turns
    assert [(m.modality, m.source) for m in turn.media] == [("audio", str(a))]
    assert turn.media[0].audio()[1] == 16000
    (turn,) = from_gym_result(_audio_result({"audio_paths": [str(a), str(b)]}), media_policy=policy).turns
    assert [m.source for m in turn.media] == [str(a), str(b)]
    # the model server's renderer reads it the same way, before the user's text
    messages = responses_to_messages("how many?", metadata={"audio_path": str(a)}, policy=policy)
    assert [type(p).__name__ for p in messages[0].parts] == ["MediaItem", "str"]


def test_audio_path_outside_the_allowed_roots_is_refused_clearly(tmp_path: Path) -> None:
    a = _wav(tmp_path / "a.wav")
    with pytest.raises(TrajectoryError, match=r"metadata: audio refused: .*allowed"):
        from_gym_result(_audio_result({"audio_path": str(a)}))  # default policy: no local root


@pytest.mark.parametrize(
    ("metadata", "match"),
    [
        ({"audio_path": "clips/a.wav"}, "relative path"),
        ({"audio_paths": "/x/a.wav"}, "must be a list"),
        ({"audio_paths": ["/x/a.wav", ""]}, r"audio_paths\[1\] must be a non-empty string"),
        ({"audio_data": "data:audio/wav;base64,AAAA", "audio_path": "/x/a.wav"}, "mutually exclusive"),
    ],
)
def test_bad_metadata_audio_is_a_clear_error(metadata: dict[str, Any], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        metadata_audio_refs(metadata)
    with pytest.raises(TrajectoryError, match=match):
        from_gym_result(_audio_result(metadata))


# ----------------------------------------------------------------- unknown media parts
def test_regression_bare_image_part_is_read_as_an_image() -> None:
    """{"type": "image", "image": url} (Hugging Face chat style) was passed over as unknown: its
    image was dropped and the turn trained placeholders without it."""
    out = [user_msg([{"type": "image", "image": RED}, {"type": "text", "text": "click"}])]
    out.append(assistant("a", **tok([1, 2], [3])))
    (turn,) = from_gym_result(result(out)).turns
    assert [(m.modality, m.source) for m in turn.media] == [("image", RED)]


@pytest.mark.parametrize(
    "part",
    [
        {"type": "screenshot", "image_url": RED},
        {"type": "custom_media", "payload": GREEN},
        {"type": "frame", "video_url": "file:///x.mp4"},
    ],
)
def test_unknown_part_type_carrying_media_is_a_typed_error(part: dict[str, Any]) -> None:
    out = [user_msg([part]), assistant("a", **tok([1, 2], [3]))]
    with pytest.raises(
        TrajectoryError, match=f"content part type {part['type']!r} is not a known media part"
    ):
        from_gym_result(result(out))


def test_unknown_part_type_without_media_is_still_context() -> None:
    out = [user_msg([{"type": "annotation", "note": "plain text"}]), assistant("a", **tok([1, 2], [3]))]
    (turn,) = from_gym_result(result(out)).turns
    assert turn.media == []
