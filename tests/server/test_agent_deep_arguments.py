"""Tool-call arguments from model output are held to the JSON nesting limit (never an agent 5xx).

A model may emit any text as a call's ``arguments``. Nested 300 levels deep they parsed, then
failed when the agent wrote them to the tool (orjson writes at most 254 levels): ``/run``
answered ``500 "TypeError('Recursion limit reached')"`` and the client retried it as an
infrastructure fault. Now such a call is a tool error the model sees, as non-JSON arguments are.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gymbridge.client import GymClient
from gymbridge.limits import MAX_JSON_DEPTH
from gymbridge.server import ResourcesServer, Session, SimpleAgent, VerifyResult, start_server, tool
from gymbridge.server._episode import tool_call_request
from gymbridge.testing.scripted_model import ScriptedModelServer

TOO_DEEP = json.dumps({"error": f"Invalid tool call arguments: nested deeper than {MAX_JSON_DEPTH} levels"})


def nested(levels: int) -> str:
    """``{"x": [[...[0]...]]}``: ``levels`` arrays/objects deep, as raw text (no recursion to build it)."""
    return '{"x": ' + "[" * (levels - 1) + "0" + "]" * (levels - 1) + "}"


class Echo(ResourcesServer):
    """One tool taking any JSON value; counts the calls that reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    @tool
    async def echo(self, x: Any) -> str:
        self.calls += 1
        return "ok"

    async def verify(self, session: Session, row: dict[str, Any], response: dict[str, Any]) -> VerifyResult:
        return VerifyResult(reward=1.0)


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH + 1, 300, 5000])
async def test_regression_deep_tool_arguments_from_the_model_are_a_tool_error_not_a_500(levels: int) -> None:
    env_server = Echo()
    row = {"responses_create_params": {"input": "go", "tools": Echo.function_tools()}}
    script: list[Any] = [{"calls": [{"name": "echo", "arguments": nested(levels)}]}, "done"]
    async with (
        await start_server(env_server) as env,
        ScriptedModelServer(script) as model,
        await start_server(SimpleAgent(resources_url=env.url, model_url=model.url)) as agent,
        GymClient(agent.url, backoff_initial_s=0.01) as client,
    ):
        outcome = await client.run(row)
    assert outcome.ok and outcome.attempts == 1 and outcome.status == 200, outcome.reason
    assert outcome.result is not None
    outputs = [o for o in outcome.result["response"]["output"] if o["type"] == "function_call_output"]
    assert [o["output"] for o in outputs] == [TOO_DEEP]
    assert env_server.calls == 0  # never posted


async def test_arguments_at_the_limit_still_reach_the_tool() -> None:
    env_server = Echo()
    row = {"responses_create_params": {"input": "go", "tools": Echo.function_tools()}}
    script: list[Any] = [{"calls": [{"name": "echo", "arguments": nested(MAX_JSON_DEPTH)}]}, "done"]
    async with (
        await start_server(env_server) as env,
        ScriptedModelServer(script) as model,
        await start_server(SimpleAgent(resources_url=env.url, model_url=model.url)) as agent,
        GymClient(agent.url) as client,
    ):
        outcome = await client.run(row)
    assert outcome.ok and env_server.calls == 1


@given(levels=st.integers(min_value=1, max_value=3 * MAX_JSON_DEPTH))
def test_tool_call_request_posts_exactly_the_arguments_within_the_limit(levels: int) -> None:
    call = {"call_id": "c", "name": "echo", "arguments": nested(levels)}
    got = tool_call_request(call, frozenset({"echo"}))
    if levels <= MAX_JSON_DEPTH:
        assert isinstance(got, tuple) and got[0] == "echo"
    else:
        assert got == [{"type": "function_call_output", "call_id": "c", "output": TOO_DEEP}]
