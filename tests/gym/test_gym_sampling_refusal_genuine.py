"""A model server refusing a row's sampling parameters, behind genuine NeMo Gym 0.7.0 servers.

gymbridge's ``ModelServer`` (tiny Qwen2-VL) answers 400 to ``temperature: 1e300``. Genuine
``simple_agent`` in front of it, and genuine ``vllm_model`` between it and gymbridge's agent,
turn that 400 into a 500 whose body wraps the inner one; ``GymClient`` must still record a data
failure at once (one attempt, status 400), never retry it as an infrastructure fault.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _genuine import KIND_AGENTS, KIND_MODELS, KIND_RESOURCES, GenuineStack, ref
from _gym_support import ThreadedLoop, model_port

from gymbridge.client import GymClient
from gymbridge.server import SimpleAgent, start_server
from gymbridge.server.examples import CounterEnv, counter_rows

pytestmark = [pytest.mark.gym, pytest.mark.integration]


@pytest.fixture(scope="module")
def refusing_stack(fixture_loop: ThreadedLoop, gym_log_root: Path) -> Iterator[tuple[GenuineStack, Any, Any]]:
    """Our tiny model server and counter env; genuine simple_agent and genuine vllm_model in front."""
    from gymbridge.generation.hf import HFGenerator
    from gymbridge.generation.server import ModelServer, ModelServerConfig

    tiny = HFGenerator.tiny(0)
    config = ModelServerConfig(model_name="tiny", max_model_len=tiny.max_model_len, default_max_tokens=4)
    model = ModelServer(tiny, config=config)
    fixture_loop.run(model.start(), timeout_s=120)
    env = fixture_loop.run(start_server(CounterEnv(instance_name="ours_counter")))
    stack = GenuineStack(gym_log_root / "sampling_refusal")
    stack.add("our_model", KIND_MODELS, "vllm_model", port=model_port(str(model.url)), launch=False)
    stack.add(
        "genuine_vllm_model",
        KIND_MODELS,
        "vllm_model",
        base_url=f"{model.url}/v1",
        api_key="none",
        model="tiny",
        return_token_id_information=True,
        uses_reasoning_parser=True,
    )
    stack.add("ours_counter", KIND_RESOURCES, "counter", port=env.port, launch=False)
    stack.add(
        "genuine_agent",
        KIND_AGENTS,
        "simple_agent",
        resources_server=ref(KIND_RESOURCES, "ours_counter"),
        model_server=ref(KIND_MODELS, "our_model"),
        max_steps=2,
    )
    try:
        stack.start()
        yield stack, model, env
    finally:
        stack.stop()
        fixture_loop.run(env.stop())
        fixture_loop.run(model.stop())


def _refused_row() -> dict[str, Any]:
    row = copy.deepcopy(counter_rows(1)[0])
    row["responses_create_params"]["temperature"] = 1e300
    return row


async def test_regression_genuine_simple_agent_wrapping_a_sampling_refusal_is_data_not_retried(
    refusing_stack: tuple[GenuineStack, Any, Any],
) -> None:
    stack, _, _ = refusing_stack
    async with GymClient(stack.url("genuine_agent"), backoff_initial_s=0.01, deadline_s=120) as client:
        outcome = await client.run(_refused_row())
    assert (outcome.kind, outcome.attempts, outcome.status) == ("data", 1, 400), outcome.reason
    assert "temperature" in (outcome.reason or "")


async def test_regression_our_agent_behind_genuine_vllm_model_answers_the_refusal_as_400(
    refusing_stack: tuple[GenuineStack, Any, Any],
) -> None:
    stack, _, env = refusing_stack
    agent = SimpleAgent(resources_url=env.url, model_url=stack.url("genuine_vllm_model"), max_steps=2)
    async with (
        await start_server(agent) as running,
        GymClient(running.url, backoff_initial_s=0.01, deadline_s=120) as client,
    ):
        outcome = await client.run(_refused_row())
        ok = await client.run(counter_rows(1)[0])  # the same stack serves an acceptable row
    assert (outcome.kind, outcome.attempts, outcome.status) == ("data", 1, 400), outcome.reason
    assert "temperature" in (outcome.reason or "")
    assert ok.ok, ok.reason
