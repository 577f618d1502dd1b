"""Fuzz the agent's routes (``/run``, ``/v1/responses``, ``/aggregate_metrics``): never a 5xx, always JSON.

Bodies are real rows whose ``responses_create_params.input`` / ``tools`` / ``metadata``, or the
whole row, are replaced by random JSON, and random bytes. Whatever the row, the agent answers
a 4xx (the row's fault, recorded as data by the client) or a result, and keeps serving.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gymbridge.server import SimpleAgent, start_server
from gymbridge.server.examples import CounterEnv, counter_rows
from gymbridge.testing.scripted_model import ScriptedModelServer

KEYS = ["type", "role", "content", "input", "text", "output", "arguments", "name", "call_id", "tools"]
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=4), children, max_size=4)
    ),
    max_leaves=10,
)


def body_for(path: str, data: st.DataObject) -> bytes:
    row: Any = counter_rows(1)[0]
    rcp = row["responses_create_params"]
    choice = data.draw(st.sampled_from(["input", "key", "row", "raw"]))
    if choice == "raw":
        return data.draw(st.binary(max_size=24))
    if choice == "input":
        rcp["input"] = data.draw(JSON)
    elif choice == "key":
        rcp[data.draw(st.sampled_from(["tools", "metadata", "temperature"]))] = data.draw(JSON)
    else:
        row = data.draw(JSON)
    if path.endswith("/run"):
        return orjson.dumps(row)
    if path == "/v1/responses":
        return orjson.dumps(rcp)
    return orjson.dumps({"verify_responses": data.draw(JSON)})


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
async def test_no_agent_input_yields_a_5xx_and_the_agent_stays_up(data: st.DataObject) -> None:
    env = await start_server(CounterEnv())
    model = ScriptedModelServer(["done"])
    await model.start()
    agent = await start_server(SimpleAgent(resources_url=env.url, model_url=model.url))
    try:
        async with aiohttp.ClientSession() as http:
            for path in ("/run", "/v1/responses", "/aggregate_metrics", "/ng-rollout/z-1/run"):
                async with http.post(agent.url + path, data=body_for(path, data)) as resp:
                    text = await resp.text()
                    assert resp.status < 500, f"{path} -> {resp.status}: {text[:300]}"
                    orjson.loads(text)
            async with http.get(agent.url + "/") as resp:
                assert resp.status == 200
    finally:
        await agent.stop()
        await model.stop()
        await env.stop()
