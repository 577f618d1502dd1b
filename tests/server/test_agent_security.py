"""The model cannot reach protocol routes as tools: no reward hacking through the agent.

Stock agents post any tool name the model emits to ``<env>/<name>``. On the counter env a
model that calls ``close_session`` then ``seed_session {"start": <target>}`` got reward 1.0
without doing the task, and calling ``verify`` leaked the hidden answer. The agent (and the
native loop) now calls only the tools the row offers and never a reserved route.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gymbridge.server import ResourcesServer, Session, SimpleAgent, VerifyResult, start_server, tool
from gymbridge.server._base import RESERVED_TOOL_NAMES
from gymbridge.server._episode import offered_tool_names, tool_call_request
from gymbridge.server.examples import CounterEnv, counter_rows
from gymbridge.testing.scripted_model import ScriptedModelServer

NOT_FOUND = json.dumps({"detail": "Not Found"})


class RecordingCounter(CounterEnv):
    """CounterEnv that counts the protocol calls it receives."""

    def __init__(self) -> None:
        super().__init__()
        self.seeds = 0
        self.verifies = 0
        self.closes = 0

    async def seed_session(self, session: Session, row: dict[str, Any]) -> dict[str, Any] | None:
        self.seeds += 1
        return await super().seed_session(session, row)

    async def verify(self, session: Session, row: dict[str, Any], response: dict[str, Any]) -> VerifyResult:
        self.verifies += 1
        return await super().verify(session, row, response)

    async def close(self, session: Session) -> None:
        self.closes += 1


async def run_agent(env_server: ResourcesServer, script: list[Any], row: dict[str, Any]) -> dict[str, Any]:
    env = await start_server(env_server)
    model = ScriptedModelServer(script)
    await model.start()
    agent = await start_server(SimpleAgent(resources_url=env.url, model_url=model.url))
    try:
        async with aiohttp.ClientSession() as http, http.post(agent.url + "/run", json=row) as r:
            assert r.status == 200, await r.text()
            result: dict[str, Any] = await r.json()
            return result
    finally:
        await agent.stop()
        await model.stop()
        await env.stop()


def tool_outputs(result: dict[str, Any]) -> list[Any]:
    return [o["output"] for o in result["response"]["output"] if o["type"] == "function_call_output"]


async def test_the_exploit_is_real_at_the_environment() -> None:
    """What the stock agent did for the model: re-seed the session with the target, then verify."""
    row = {**counter_rows(1)[0], "target": 3}
    env_server = CounterEnv()
    jar = aiohttp.CookieJar(unsafe=True)  # keep the env cookie on 127.0.0.1, as the agent does
    async with await start_server(env_server) as env, aiohttp.ClientSession(cookie_jar=jar) as http:
        async with http.post(env.url + "/seed_session", json=row) as r:
            assert r.status == 200
        async with http.post(env.url + "/close_session", json={}) as r:
            assert r.status == 200
        async with http.post(env.url + "/seed_session", json={"start": 3}) as r:  # the model's "tool call"
            assert r.status == 200
        body = {**row, "response": {"output": [{"type": "message", "role": "assistant", "content": []}]}}
        async with http.post(env.url + "/verify", json=body) as r:
            assert (await r.json())["reward"] == pytest.approx(1.0)  # full reward, no increment done


async def test_regression_counter_exploit_close_then_seed_session_as_tools_earns_nothing() -> None:
    """close_session + seed_session {"start": target} as tool calls gave reward 1.0; now 0.2 (the answer)."""
    row = {**counter_rows(1)[0], "target": 3}
    env = RecordingCounter()
    script = [
        {
            "calls": [
                {"name": "close_session", "arguments": {}},
                {"name": "seed_session", "arguments": {"start": 3}},
            ]
        },
        "done",
    ]
    result = await run_agent(env, script, row)
    assert result["reward"] == pytest.approx(0.2)  # only the "answered" component: the count is 0
    assert result["final_count"] == 0
    assert tool_outputs(result) == [NOT_FOUND, NOT_FOUND]
    assert env.seeds == 1 and env.closes == 0  # the agent's own seed only; the model reached neither


class HiddenAnswerEnv(ResourcesServer):
    @tool
    async def guess(self, session: Session, value: int) -> str:
        """Guess the secret."""
        return "higher" if value < 42 else "lower or equal"

    async def verify(self, session: Session, row: dict[str, Any], response: dict[str, Any]) -> VerifyResult:
        return VerifyResult(reward=0.0, extra={"secret": 42})


async def test_regression_verify_as_a_tool_does_not_leak_the_answer() -> None:
    row = {"responses_create_params": {"input": "guess", "tools": HiddenAnswerEnv.function_tools()}}
    script = [{"calls": [{"name": "verify", "arguments": {**row, "response": {"output": []}}}]}, "42"]
    result = await run_agent(HiddenAnswerEnv(), script, row)
    assert tool_outputs(result) == [NOT_FOUND]
    assert "42" not in json.dumps(tool_outputs(result))


@pytest.mark.parametrize("name", sorted(RESERVED_TOOL_NAMES - {""}))
async def test_a_reserved_route_is_never_called_even_when_the_row_lists_it(name: str) -> None:
    env = RecordingCounter()
    listed = [*CounterEnv.function_tools(), {"type": "function", "name": name, "parameters": {}}]
    row = {**counter_rows(1)[0], "target": 1}
    row["responses_create_params"] = {**row["responses_create_params"], "tools": listed}
    script = [
        {"calls": [{"name": name, "arguments": {"start": 1}}, {"name": "increment", "arguments": {}}]},
        "ok",
    ]
    result = await run_agent(env, script, row)
    assert tool_outputs(result)[0] == NOT_FOUND
    assert env.seeds == 1 and env.verifies == 1 and env.closes == 0
    assert result["final_count"] == 1  # the offered tool still works


async def test_a_tool_the_row_did_not_offer_is_not_called() -> None:
    env = RecordingCounter()
    row = {**counter_rows(1)[0], "target": 1}
    only_snapshot = [t for t in CounterEnv.function_tools() if t["name"] == "snapshot"]
    row["responses_create_params"] = {**row["responses_create_params"], "tools": only_snapshot}
    result = await run_agent(env, [{"calls": [{"name": "increment", "arguments": {"amount": 1}}]}, "ok"], row)
    assert tool_outputs(result) == [NOT_FOUND] and result["final_count"] == 0


names = st.one_of(st.sampled_from(sorted(RESERVED_TOOL_NAMES)), st.text(max_size=20))


@given(name=names, offered=st.frozensets(st.text(alphabet="abcdefgh_", min_size=1, max_size=6), max_size=5))
def test_only_offered_non_reserved_names_are_ever_posted(name: str, offered: frozenset[str]) -> None:
    tools = [{"type": "function", "name": n} for n in [*offered, *RESERVED_TOOL_NAMES]]
    allowed = offered_tool_names({"tools": tools})
    assert allowed == offered - RESERVED_TOOL_NAMES
    got = tool_call_request({"call_id": "c", "name": name, "arguments": "{}"}, allowed)
    if name in offered and name not in RESERVED_TOOL_NAMES:
        assert got == (name, {})
    else:
        assert got == [{"type": "function_call_output", "call_id": "c", "output": NOT_FOUND}]


def test_chat_style_tool_specs_count_as_offered() -> None:
    rcp = {"tools": [{"type": "function", "function": {"name": "add"}}, {"type": "web_search"}, "junk"]}
    assert offered_tool_names(rcp) == frozenset({"add"})


@pytest.mark.parametrize("name", sorted(RESERVED_TOOL_NAMES - {""}))
def test_the_sdk_refuses_a_tool_under_a_reserved_name(name: str) -> None:
    with pytest.raises(TypeError, match="collides with a protocol endpoint"):

        class Bad(ResourcesServer):
            @tool(name=name)
            async def anything(self) -> str:
                """x"""
                return "x"
