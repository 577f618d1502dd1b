"""Image, video and audio through training on the tiny Qwen2.5-Omni thinker, on both rollout paths.

One episode: the prompt holds an image, a ``listen`` tool returns an audio clip (22.05 kHz:
resampled to the extractor's 16 kHz), a later ``watch`` tool returns a video. The tiny model has
random weights, so the two tool calls are forced (their logprobs are the model's own,
teacher-forced by the generator) and the last turn is sampled. What the user would notice:

* each medium lands on the turn that saw it (image -> turn 1, audio -> turn 2, video -> turn 3);
* the trainer's teacher-forced logprobs over the ``TrainBatch`` (media processed once per
  content key by ``MediaProcessor``, passed under the model's names) reproduce the logprobs the
  generator reported to < 1e-5 in fp32, natively and through model server + agent.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from omni_helpers import MixedMediaServer, call_tokens, mixed_row, trainer_max_logprob_diff

from gymbridge.generation.hf import HFGenerator
from gymbridge.generation.scripted import ScriptedGenerator
from gymbridge.generation.types import SamplingConfig
from gymbridge.models.tiny_omni import TinyOmni
from gymbridge.trajectory import Trajectory, from_gym_result

pytestmark = pytest.mark.integration

TEMPERATURE = 0.8


@pytest.fixture
async def mixed_env() -> AsyncIterator[str]:
    from gymbridge.server import start_server

    async with await start_server(MixedMediaServer()) as running:
        yield running.url


def script(gen: HFGenerator) -> list[list[int] | None]:
    return [call_tokens(gen, "listen"), call_tokens(gen, "watch"), None]


def assert_media_per_turn(traj: Trajectory) -> None:
    assert [t.kind for t in traj.turns] == ["function_call", "function_call", "message"]
    assert [[m.modality for m in t.media] for t in traj.turns] == [["image"], ["audio"], ["video"]]
    assert traj.num_segments == 1


async def test_native_image_audio_video_episode_is_token_exact_through_the_trainer(
    tiny_omni: TinyOmni, tiny_omni_gen: HFGenerator, mixed_env: str
) -> None:
    from gymbridge.rollout import NativeModel, run_episode

    scripted = ScriptedGenerator(tiny_omni_gen, script(tiny_omni_gen))
    sampling = SamplingConfig(temperature=TEMPERATURE, max_tokens=10, seed=3)
    model = NativeModel(
        scripted, tiny_omni_gen.codec, max_model_len=tiny_omni_gen.max_model_len, sampling=sampling
    )
    result = await run_episode(scripted, mixed_env, mixed_row(), max_turns=3, model=model)
    traj = from_gym_result(result)
    assert_media_per_turn(traj)
    # the refresh rule: the last call saw all three media of the conversation
    assert {k: len(v) for k, v in scripted.inputs_seen[-1].multi_modal_data.items()} == {
        "image": 1,
        "audio": 1,
        "video": 1,
    }
    assert trainer_max_logprob_diff(tiny_omni.model, tiny_omni.processor, [traj], TEMPERATURE) < 1e-5


async def test_gym_path_image_audio_video_episode_is_token_exact_through_the_trainer(
    tiny_omni: TinyOmni, tiny_omni_gen: HFGenerator, mixed_env: str
) -> None:
    """gymbridge's SimpleAgent -> the model server (Responses API) -> the environment; same exactness."""
    import httpx

    from gymbridge.generation.server import ModelServer, ModelServerConfig
    from gymbridge.server import SimpleAgent, start_server

    scripted = ScriptedGenerator(tiny_omni_gen, script(tiny_omni_gen))
    config = ModelServerConfig(
        model_name="tiny-omni", max_model_len=tiny_omni_gen.max_model_len, batching=False
    )
    async with ModelServer(scripted, config=config) as server:
        agent = SimpleAgent(resources_url=mixed_env, model_url=str(server.url), max_steps=3)
        async with await start_server(agent) as running, httpx.AsyncClient(timeout=120) as client:
            reply = await client.post(f"{running.url}/run", json=mixed_row())
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    traj = from_gym_result(result)
    assert_media_per_turn(traj)
    assert trainer_max_logprob_diff(tiny_omni.model, tiny_omni.processor, [traj], TEMPERATURE) < 1e-5
