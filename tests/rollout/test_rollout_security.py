"""The native loop calls only the tools a row offers, never a protocol route (as ``SimpleAgent``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gymbridge.generation.hf import HFGenerator
from gymbridge.generation.scripted import ScriptedGenerator
from gymbridge.generation.types import SamplingConfig
from gymbridge.limits import MAX_JSON_DEPTH
from gymbridge.rollout import NativeModel, run_episode
from gymbridge.server import Session, start_server, tool
from gymbridge.server.examples import CounterEnv, counter_rows

pytestmark = pytest.mark.integration


def call_tokens(gen: HFGenerator, name: str, arguments: dict[str, Any]) -> list[int]:
    text = "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"
    ids = gen.tokenizer(text, add_special_tokens=False)["input_ids"]
    return [int(t) for t in ids] + [gen.codec.end_of_turn_id]


class SeedCounting(CounterEnv):
    def __init__(self) -> None:
        super().__init__()
        self.seeds = 0

    async def seed_session(self, session: Session, row: dict[str, Any]) -> dict[str, Any] | None:
        self.seeds += 1
        return await super().seed_session(session, row)


async def test_regression_native_loop_refuses_a_protocol_route_as_a_tool(tiny_gen: HFGenerator) -> None:
    """The counter exploit through the native loop: ``seed_session {"start": target}`` as a tool."""
    row = {**counter_rows(1)[0], "target": 3}
    script = [call_tokens(tiny_gen, "seed_session", {"start": 3}), None]
    scripted = ScriptedGenerator(tiny_gen, script)
    sampling = SamplingConfig(temperature=0.8, max_tokens=4, seed=7)
    model = NativeModel(scripted, tiny_gen.codec, max_model_len=tiny_gen.max_model_len, sampling=sampling)
    env_server = SeedCounting()
    async with await start_server(env_server) as env:
        result = await run_episode(scripted, env.url, row, max_turns=2, model=model, mode="tools")
    outputs = [o["output"] for o in result["response"]["output"] if o["type"] == "function_call_output"]
    assert outputs == [json.dumps({"detail": "Not Found"})]
    assert env_server.seeds == 1 and result["final_count"] == 0


class Echo(CounterEnv):
    """CounterEnv with one more tool taking any JSON value; counts the calls that reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.echoes = 0

    @tool
    async def echo(self, x: Any) -> str:
        self.echoes += 1
        return "ok"


async def test_regression_native_loop_answers_deep_tool_arguments_with_a_tool_error(
    tiny_gen: HFGenerator,
) -> None:
    """Arguments nested 300 deep from the model: a tool error the model sees, never posted."""
    deep: Any = 0
    for _ in range(299):
        deep = [deep]
    row = {**counter_rows(1)[0]}
    row["responses_create_params"] = {**row["responses_create_params"], "tools": Echo.function_tools()}
    script = [call_tokens(tiny_gen, "echo", {"x": deep}), None]
    scripted = ScriptedGenerator(tiny_gen, script)
    sampling = SamplingConfig(temperature=0.8, max_tokens=4, seed=7)
    model = NativeModel(scripted, tiny_gen.codec, max_model_len=tiny_gen.max_model_len, sampling=sampling)
    env_server = Echo()
    async with await start_server(env_server) as env:
        result = await run_episode(scripted, env.url, row, max_turns=2, model=model, mode="tools")
    outputs = [o["output"] for o in result["response"]["output"] if o["type"] == "function_call_output"]
    assert outputs == [
        json.dumps({"error": f"Invalid tool call arguments: nested deeper than {MAX_JSON_DEPTH} levels"})
    ]
    assert env_server.echoes == 0
