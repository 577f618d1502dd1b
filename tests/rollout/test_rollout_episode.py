"""Native rollouts and the model-server path on zoom_read: token exactness, the refresh rule.

The tiny model has random weights, so it never emits a tool call by itself: the
:class:`ScriptedGenerator` forces the zoom calls (their logprobs are the model's own,
teacher-forced) and lets the model sample the rest.
"""

from __future__ import annotations

from typing import Any

import pytest
from gen_helpers import max_logprob_diff
from rollout_helpers import run_via_model_server, zoom_call_tokens

from gymbridge.generation.hf import HFGenerator
from gymbridge.generation.scripted import ScriptedGenerator
from gymbridge.generation.types import SamplingConfig
from gymbridge.rollout import NativeModel, run_episode, run_group
from gymbridge.trajectory import from_gym_result
from gymbridge.trajectory.types import GenerationInput

pytestmark = pytest.mark.integration

# top_p stays 1: forced (scripted) turns are scored without a nucleus; HF tests cover top-p
SAMPLING = SamplingConfig(temperature=0.8, max_tokens=12, seed=7)


def three_turn_script(gen: HFGenerator) -> list[list[int] | None]:
    return [zoom_call_tokens(gen, [0, 0, 128, 128]), zoom_call_tokens(gen, [100, 100, 200, 200]), None]


async def native_episode(
    tiny_gen: HFGenerator, env: str, row: dict[str, Any]
) -> tuple[dict[str, Any], NativeModel]:
    scripted = ScriptedGenerator(tiny_gen, three_turn_script(tiny_gen))
    model = NativeModel(scripted, tiny_gen.codec, max_model_len=tiny_gen.max_model_len, sampling=SAMPLING)
    result = await run_episode(scripted, env, row, max_turns=3, model=model)
    return result, model


def tool_image_keys(result: dict[str, Any]) -> list[str]:
    """Content keys of the images the environment returned, in order."""
    from gymbridge.media import load_media

    keys = []
    for item in result["response"]["output"]:
        if item.get("type") == "message" and item.get("role") == "user":
            for part in item["content"]:
                if part.get("type") == "input_image":
                    keys.append(load_media(part["image_url"], "image").key)
    return keys


async def test_native_three_turn_zoom_read_is_token_exact(
    tiny_gen: HFGenerator, tiny: Any, zoom_env: str, zoom_row: dict[str, Any]
) -> None:
    result, model = await native_episode(tiny_gen, zoom_env, zoom_row)
    assert isinstance(result["reward"], float)
    traj = from_gym_result(result)
    assert [t.kind for t in traj.turns] == ["function_call", "function_call", "message"]
    assert traj.num_segments == 1
    assert [len(t.media) for t in traj.turns] == [1, 1, 1]  # preview, crop 1 (turn 2), crop 2 (turn 3)
    assert max_logprob_diff(tiny, traj, SAMPLING) < 1e-5
    # the generator's last input is exactly the trajectory's tokens before the last generation
    last = traj.turns[-1]
    assert model.inputs[-1].prompt_token_ids == traj.token_ids()[: -len(last.generation_token_ids)]


async def test_model_server_path_is_token_exact(
    tiny_gen: HFGenerator, tiny: Any, zoom_env: str, zoom_row: dict[str, Any]
) -> None:
    """gymbridge's SimpleAgent -> our model server (Responses API) -> zoom_read; same exactness."""
    scripted = ScriptedGenerator(tiny_gen, three_turn_script(tiny_gen))
    result = await run_via_model_server(
        scripted, zoom_env, zoom_row, max_steps=3, max_model_len=tiny_gen.max_model_len
    )
    traj = from_gym_result(result)
    assert [t.kind for t in traj.turns] == ["function_call", "function_call", "message"]
    sampling = SamplingConfig(temperature=0.8, max_tokens=12)
    assert max_logprob_diff(tiny, traj, sampling) < 1e-5
    assert len(scripted.inputs_seen[2].multi_modal_data["image"]) == 3


def assert_sees_tool_image(inp: GenerationInput, tool_key: str, image_token_id: int, tiny: Any) -> None:
    """The turn-2 check: the input carries the tool's image AND placeholders for every image it carries."""
    keys = [m.key for m in inp.media]
    assert tool_key in keys, "the generator did not receive the tool's image"
    images = inp.multi_modal_data.get("image", [])
    assert len(images) == len(inp.media)
    grid = tiny.processor.image_processor(images=images, return_tensors="pt")["image_grid_thw"]
    assert inp.prompt_token_ids.count(image_token_id) == sum(tiny.processor.num_image_tokens(grid))


async def test_regression_stale_turn0_prompt(
    tiny_gen: HFGenerator, tiny: Any, zoom_env: str, zoom_row: dict[str, Any]
) -> None:
    """Regression: later turns generated from the stale turn-0 prompt (NeMo-RL, slime, verl, TRL).

    The generator must receive the zoom crop at turn 2 (the call after the tool
    answered), with its placeholders in the prompt; an input rebuilt from turn-0
    content fails the same check.
    """
    result, model = await native_episode(tiny_gen, zoom_env, zoom_row)
    crops = tool_image_keys(result)
    assert len(crops) == 2
    turn0, turn2 = model.inputs[0], model.inputs[1]
    assert_sees_tool_image(turn2, crops[0], tiny.image_token_id, tiny)
    assert len(turn2.media) == 2 and turn2.media[0].key == turn0.media[0].key
    assert turn2.prompt_token_ids[: len(turn0.prompt_token_ids)] == turn0.prompt_token_ids
    # the control: what the buggy frameworks sent at turn 2
    stale = GenerationInput(turn0.prompt_token_ids, turn0.multi_modal_data, turn0.media)
    with pytest.raises(AssertionError, match="did not receive the tool's image"):
        assert_sees_tool_image(stale, crops[0], tiny.image_token_id, tiny)
    # and media refreshed without the tokens is refused by the generator itself
    half = GenerationInput(turn0.prompt_token_ids, turn2.multi_modal_data, turn2.media)
    with pytest.raises(AssertionError):
        assert_sees_tool_image(half, crops[0], tiny.image_token_id, tiny)


async def test_gymnasium_observation_images_reach_later_turns(tiny_gen: HFGenerator) -> None:
    from gymbridge.server import start_server
    from gymbridge_envs.registry import get_env

    spec = get_env("grid_door")
    row = spec.make_row(0, 0)
    model = NativeModel(
        tiny_gen,
        tiny_gen.codec,
        max_model_len=tiny_gen.max_model_len,
        sampling=SamplingConfig(max_tokens=6, seed=0),
    )
    async with await start_server(spec.make_server()) as env:
        result = await run_episode(tiny_gen, env.url, row, max_turns=3, mode="gymnasium", model=model)
    assert {"response", "reward", "terminated", "truncated", "info", "responses_create_params"} <= set(result)
    counts = [len(i.multi_modal_data.get("image", [])) for i in model.inputs]
    assert len(counts) == 3, "random actions neither win nor end a grid_door episode in 3 steps"
    assert counts == [1, 2, 3]  # the reset image, then one more observation image per step
    for earlier, later in zip(model.inputs, model.inputs[1:], strict=False):
        assert later.prompt_token_ids[: len(earlier.prompt_token_ids)] == earlier.prompt_token_ids
    traj = from_gym_result(result)
    assert len(traj.turns) == len(model.inputs)


async def test_group_runs_concurrently_and_records_failures(
    tiny_gen: HFGenerator, zoom_row: dict[str, Any]
) -> None:
    from gymbridge.server import free_port, start_server
    from gymbridge_envs.registry import get_env

    row = get_env("counter").make_row(0, 0)
    async with await start_server(get_env("counter").make_server()) as env:
        results = await run_group(
            tiny_gen, env.url, row, num_rollouts=3, max_turns=2, sampling=SamplingConfig(max_tokens=4, seed=1)
        )
    assert [r["_ng_rollout_index"] for r in results] == [0, 1, 2]
    assert all(isinstance(r["reward"], float) and r["response"]["output"] for r in results)
    dead = f"http://127.0.0.1:{free_port()}"
    failed = await run_group(tiny_gen, dead, row, num_rollouts=2, max_turns=1, timeout_s=2.0)
    assert all(r["mask_sample"] and r["failure_kind"] == "EnvTransportError" for r in failed)


async def test_context_overflow_ends_the_episode_as_incomplete(
    tiny_gen: HFGenerator, zoom_env: str, zoom_row: dict[str, Any]
) -> None:
    result = await run_episode(tiny_gen, zoom_env, zoom_row, max_turns=3, max_model_len=64)
    assert result["response"]["status"] == "incomplete"
    assert result["response"]["output"] == [] and isinstance(result["reward"], float)


def test_a_prompt_that_does_not_extend_the_history_is_refused(tiny_gen: HFGenerator) -> None:
    from gymbridge.errors import TrajectoryError

    model = NativeModel(tiny_gen, tiny_gen.codec, max_model_len=100)
    model._advance([1, 2, 3], [])
    model.history.append([4])
    model._advance([1, 2, 3, 4, 5], [])  # extends: fine
    with pytest.raises(TrajectoryError, match="does not extend"):
        model._advance([1, 2, 9, 4, 5, 6], [])


async def test_withhold_later_media_hides_tool_images_from_the_generator_only(
    tiny_gen: HFGenerator, tiny: Any, zoom_env: str, zoom_row: dict[str, Any]
) -> None:
    """The stale-prompt control (``withhold_token_ids``): the generator's input after turn 0 has
    neither the tool's crops nor their placeholders, while the recorded turns (what trains) keep them."""
    scripted = ScriptedGenerator(tiny_gen, three_turn_script(tiny_gen))
    model = NativeModel(
        scripted,
        tiny_gen.codec,
        max_model_len=tiny_gen.max_model_len,
        sampling=SAMPLING,
        withhold_token_ids=tiny_gen.suppressed_token_ids,
    )
    result = await run_episode(scripted, zoom_env, zoom_row, max_turns=3, model=model)
    crops = tool_image_keys(result)
    assert len(crops) == 2
    traj = from_gym_result(result)
    assert [len(t.media) for t in traj.turns] == [1, 1, 1]  # the trained turns keep both crops
    turn0, turn1, turn2 = model.inputs
    for later in (turn1, turn2):
        assert [m.key for m in later.media] == [turn0.media[0].key]  # the preview only
        assert later.prompt_token_ids.count(tiny.image_token_id) == turn0.prompt_token_ids.count(
            tiny.image_token_id
        )
        assert later.prompt_token_ids[: len(turn0.prompt_token_ids)] == turn0.prompt_token_ids
    with pytest.raises(AssertionError, match="did not receive the tool's image"):
        assert_sees_tool_image(turn1, crops[0], tiny.image_token_id, tiny)
    # everything else reaches the generator: the tool's text, the earlier turns, token for token
    t0, t1 = traj.turns[0], traj.turns[1]
    hidden = set(tiny_gen.suppressed_token_ids)
    kept = [t for t in t1.prompt_token_ids if t not in hidden]
    expected = t0.prompt_token_ids + t0.generation_token_ids + kept
    assert turn1.prompt_token_ids == expected
    assert len(expected) < len(t0.prompt_token_ids + t0.generation_token_ids + t1.prompt_token_ids)


async def test_forced_first_call_reaches_the_tool_image_and_then_samples(
    tiny_gen: HFGenerator, tiny: Any
) -> None:
    """``forced_first_call``: the first model call emits the given tokens (scored with the model's own
    logprobs), the tool's image reaches the second call, which samples."""
    from gymbridge.server import start_server
    from gymbridge_envs.color_pick.data import LOOK_CALL
    from gymbridge_envs.registry import get_env

    spec = get_env("color_pick")
    row = spec.make_row(0, 0, reveal="tool")
    call = tiny_gen.tokenizer(LOOK_CALL, add_special_tokens=False)["input_ids"]
    forced = [*call, tiny_gen.codec.end_of_turn_id]
    sampling = SamplingConfig(temperature=1.0, max_tokens=4, seed=3)
    async with await start_server(spec.make_server()) as env:
        model = NativeModel(
            tiny_gen,
            tiny_gen.codec,
            max_model_len=tiny_gen.max_model_len,
            sampling=sampling,
            forced_first_call=forced,
        )
        result = await run_episode(tiny_gen, env.url, row, max_turns=2, model=model)
    traj = from_gym_result(result)
    assert [t.kind for t in traj.turns] == ["function_call", "message"]
    assert traj.turns[0].generation_token_ids == forced
    assert len(traj.turns[1].media) == 1  # the look image, at the second call
    assert [m.key for m in model.inputs[1].media] == [traj.turns[1].media[0].key]
    assert max_logprob_diff(tiny, traj, sampling) < 1e-5  # forced tokens carry the model's own logprobs
