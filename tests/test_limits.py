"""One JSON nesting limit for every body gymbridge accepts (orjson reads 1024 levels, writes 254)."""

from __future__ import annotations

from typing import Any

import aiohttp
import httpx
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gymbridge.client import GymClient
from gymbridge.errors import JsonTooDeepError, ProtocolError
from gymbridge.limits import MAX_JSON_DEPTH, check_json_depth, json_too_deep, loads_json
from gymbridge.server import SimpleAgent, start_server
from gymbridge.server.examples import CounterEnv, counter_rows
from gymbridge.testing.scripted_model import ScriptedModelServer

DEPTHS = [MAX_JSON_DEPTH + 1, 254, 255, 600, 1024]


def nested(depth: int, leaf: Any = 0) -> Any:
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def reference_depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((reference_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((reference_depth(v) for v in value), default=0)
    return 0


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**63 - 1) | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=3), children, max_size=3)
    ),
    max_leaves=40,
)


@given(value=json_values, limit=st.integers(min_value=0, max_value=8))
def test_json_too_deep_matches_a_reference_depth(value: Any, limit: int) -> None:
    assert json_too_deep(value, limit) == (reference_depth(value) > limit)


@given(value=json_values)
def test_loads_json_accepts_what_is_within_the_limit(value: Any) -> None:
    assert loads_json(orjson.dumps(value)) == value


@pytest.mark.parametrize("depth", DEPTHS)
def test_loads_json_refuses_deeper_input_without_recursing(depth: int) -> None:
    raw = orjson.dumps(nested(min(depth, 250)))
    if depth > 250:  # beyond what orjson writes: build the text by hand
        raw = b"[" * depth + b"]" * depth
    with pytest.raises(JsonTooDeepError, match=f"deeper than {MAX_JSON_DEPTH}"):
        loads_json(raw)
    assert loads_json(orjson.dumps(nested(MAX_JSON_DEPTH))) == nested(MAX_JSON_DEPTH)


def test_a_limit_at_the_boundary_is_accepted_and_one_more_refused() -> None:
    check_json_depth(nested(MAX_JSON_DEPTH))
    with pytest.raises(ProtocolError):
        check_json_depth(nested(MAX_JSON_DEPTH + 1))


@pytest.mark.parametrize("depth", DEPTHS)
async def test_regression_the_sdk_and_the_agent_answer_400_to_deep_bodies(depth: int) -> None:
    """The agent answered 500 to a row nested 255-1024 levels deep."""
    env = await start_server(CounterEnv())
    model = ScriptedModelServer(["done"])
    await model.start()
    agent = await start_server(SimpleAgent(resources_url=env.url, model_url=model.url))
    raw = b'{"responses_create_params": {"input": "hi"}, "extra": ' + b"[" * depth + b"]" * depth + b"}"
    try:
        async with aiohttp.ClientSession() as http:
            for url in (agent.url + "/run", env.url + "/seed_session", env.url + "/increment"):
                async with http.post(url, data=raw, headers={"content-type": "application/json"}) as r:
                    assert r.status == 400, (url, await r.text())
                    assert "deeper than" in (await r.json())["detail"]
    finally:
        await agent.stop()
        await model.stop()
        await env.stop()


@pytest.mark.parametrize("depth", DEPTHS)
async def test_regression_gym_client_run_never_raises_type_error_for_deep_rows(depth: int) -> None:
    """``GymClient.run`` raised ``TypeError`` (orjson cannot write > 254 levels)."""
    sent: list[bytes] = []
    transport = httpx.MockTransport(lambda req: sent.append(req.content) or httpx.Response(500))
    row = {**counter_rows(1)[0], "extra": nested(min(depth, 1000))}
    async with GymClient("http://agent.test", transport=transport) as client:
        outcome = await client.run(row)
    assert outcome.kind == "data" and "deeper than" in (outcome.reason or "")
    assert sent == []


@pytest.mark.parametrize("depth", DEPTHS)
async def test_regression_a_deep_agent_result_is_a_data_outcome(depth: int) -> None:
    body = b'{"reward": 1.0, "response": {"output": []}, "x": ' + b"[" * depth + b"]" * depth + b"}"
    transport = httpx.MockTransport(lambda req: httpx.Response(200, content=body))
    async with GymClient("http://agent.test", transport=transport) as client:
        outcome = await client.run(counter_rows(1)[0])
    assert outcome.kind == "data" and "deeper than" in (outcome.reason or "")


async def test_regression_an_oversized_body_is_413_at_the_sdk_and_the_agent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gymbridge.server._base as base

    monkeypatch.setattr(base, "MAX_BODY_BYTES", 1024 * 1024)
    env = await start_server(CounterEnv())
    agent = await start_server(SimpleAgent(resources_url=env.url, model_url="http://127.0.0.1:9"))
    big = b'{"x": "' + b"a" * (2 * 1024 * 1024) + b'"}'
    try:
        async with aiohttp.ClientSession() as http:
            for url in (env.url + "/seed_session", agent.url + "/run"):
                async with http.post(url, data=big, headers={"content-type": "application/json"}) as r:
                    assert r.status == 413, (url, await r.text())
                    assert "limit" in (await r.json())["detail"]
    finally:
        await agent.stop()
        await env.stop()
