"""The native loop never trains on an environment fault in the middle of an episode (as the agent).

A tool or ``/step`` that breaks the connection, passes its deadline or answers 502 / 503 / 504 /
408 / 429 raises :class:`~gymbridge.errors.EnvFaultError` (``gymbridge.faults``), so the rollout
is a failure of class ``env_fault`` naming the tool and the status; the native loop used to show
a 408 / 429 to the model as the tool's output and train on the rollout. Faults are injected on
loopback by :class:`~gymbridge.testing.fault_proxy.FaultProxy`.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from gymbridge.bridge import NativeRollouts
from gymbridge.errors import EnvFaultError
from gymbridge.generation.hf import HFGenerator
from gymbridge.generation.scripted import ScriptedGenerator
from gymbridge.generation.types import SamplingConfig
from gymbridge.rollout import NativeModel, run_episode
from gymbridge.server import start_server
from gymbridge.server.examples import CounterEnv, StepCounterEnv, counter_rows, step_counter_rows
from gymbridge.testing.fault_proxy import Fault, FaultProxy

pytestmark = pytest.mark.integration

SAMPLING = SamplingConfig(temperature=0.8, max_tokens=4, seed=7)


def increment_call(gen: HFGenerator) -> list[int]:
    text = "<tool_call>\n" + json.dumps({"name": "increment", "arguments": {"amount": 1}}) + "\n</tool_call>"
    ids = gen.tokenizer(text, add_special_tokens=False)["input_ids"]
    return [int(t) for t in ids] + [gen.codec.end_of_turn_id]


@pytest.mark.parametrize(
    ("fault", "kind", "status"),
    [
        (502, "transport_unreachable", 502),
        (429, "transport_unreachable", 429),
        ("close_mid_body", "transport_peer_drop", None),
    ],
)
async def test_regression_native_tool_fault_is_an_env_fault_failure(
    tiny_gen: HFGenerator, fault: Any, kind: str, status: int | None
) -> None:
    scripted = ScriptedGenerator(tiny_gen, [increment_call(tiny_gen), None])
    model = NativeModel(scripted, tiny_gen.codec, max_model_len=tiny_gen.max_model_len, sampling=SAMPLING)
    async with (
        await start_server(CounterEnv()) as env,
        FaultProxy(env.url, {"/increment": Fault(fault)}) as proxy,
    ):
        with pytest.raises(EnvFaultError) as err:
            await run_episode(scripted, proxy.url, counter_rows(1)[0], max_turns=2, model=model, mode="tools")
        # through the bridge's native source: the rollout's record, never a trained trajectory
        source = NativeRollouts(
            ScriptedGenerator(tiny_gen, [increment_call(tiny_gen)]),
            proxy.url,
            max_turns=2,
            sampling=SAMPLING,
            mode="tools",
        )
        (record,) = await source.rollouts(counter_rows(1)[0], task_index=0, group_size=1)
        await source.aclose()
    assert (err.value.tool, err.value.status, err.value.failure_kind) == ("increment", status, kind)
    assert err.value.route == "/increment"
    assert not record.ok and record.failure_class == "env_fault"
    assert "tool 'increment'" in (record.failure_reason or "")
    assert proxy.injected["/increment"] == 2


async def test_regression_native_step_fault_is_an_env_fault_failure(tiny_gen: HFGenerator) -> None:
    async with (
        await start_server(StepCounterEnv()) as env,
        FaultProxy(env.url, {"/step": Fault(503)}) as proxy,
    ):
        with pytest.raises(EnvFaultError) as err:
            await run_episode(
                tiny_gen, proxy.url, step_counter_rows(1)[0], max_turns=2, mode="gymnasium", sampling=SAMPLING
            )
    assert (err.value.route, err.value.tool, err.value.status) == ("/step", None, 503)
    assert "/step answered HTTP 503" in str(err.value)
