"""A session the environment does not know is an error, never a fresh empty session.

A restarted environment used to answer a tool call or ``verify`` with an old cookie from a
fresh empty session: 16 of 16 in-flight rollouts were trained with reward 0.0 and no failure
flag. Now the server answers 409 ``env_session_lost``, the agent ends the rollout with the
same status and header, and the client and the bridge record a failure of that class.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from gymbridge.bridge import BridgeConfig, BridgeIterator, BridgeStalledError, GymRollouts
from gymbridge.client import GymClient
from gymbridge.server import RunningServer, SimpleAgent, start_server
from gymbridge.server._base import ERROR_HEADER, SESSION_LOST
from gymbridge.server.examples import CounterEnv, counter_rows
from gymbridge.testing.scripted_model import ScriptedModelServer

VERIFY_BODY = {
    "responses_create_params": {"input": "x"},
    "response": {"output": [{"type": "message", "role": "assistant", "content": []}]},
}


def cookie(server: CounterEnv, value: str) -> dict[str, str]:
    return {"Cookie": f"{server.cookie_name}={value}"}


async def post(
    http: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str]
) -> tuple[int, Any, aiohttp.ClientResponse]:
    async with http.post(url, json=body, headers=headers) as r:
        return r.status, await r.json(content_type=None), r


@pytest.mark.parametrize(("path", "body"), [("/increment", {"amount": 1}), ("/verify", VERIFY_BODY)])
async def test_regression_unknown_session_on_a_tool_call_or_verify_is_409(path: str, body: Any) -> None:
    server = CounterEnv()
    async with await start_server(server) as env, aiohttp.ClientSession() as http:
        status, reply, r = await post(http, env.url + path, body, cookie(server, "minted-by-a-dead-process"))
        assert status == 409 and r.headers[ERROR_HEADER] == SESSION_LOST
        assert reply["error"] == SESSION_LOST and "unknown session" in reply["detail"]
        assert "seed_session" in reply["detail"]  # says how to recover
    assert server.num_sessions == 0  # nothing was created for it


async def test_seed_session_still_starts_a_session_for_an_unknown_cookie() -> None:
    server = CounterEnv()
    async with await start_server(server) as env, aiohttp.ClientSession() as http:
        headers = cookie(server, "old-cookie")
        assert (await post(http, env.url + "/seed_session", {"start": 5}, headers))[0] == 200
        status, reply, _ = await post(http, env.url + "/increment", {"amount": 1}, headers)
        assert status == 200 and reply == {"count": 6}


async def test_an_evicted_session_cannot_be_continued_a_closed_one_starts_afresh() -> None:
    server = CounterEnv(max_sessions=1)
    async with await start_server(server) as env, aiohttp.ClientSession() as http:
        _, _, first = await post(http, env.url + "/seed_session", {"start": 4}, {})
        a = cookie(server, first.cookies[server.cookie_name].value)
        await post(http, env.url + "/close_session", {}, a)
        status, reply, _ = await post(http, env.url + "/increment", {}, a)
        assert status == 200 and reply == {"count": 1}  # the client closed it: a fresh one, as stock
        await post(http, env.url + "/seed_session", {}, {})  # a second session evicts the first
        status, reply, _ = await post(http, env.url + "/increment", {}, a)
        assert status == 409 and reply["error"] == SESSION_LOST  # evicted: never silently fresh
        await post(http, env.url + "/seed_session", {}, a)  # re-seeding the cookie starts one
        assert (await post(http, env.url + "/increment", {}, a))[0] == 200


async def test_no_cookie_or_an_unstored_minted_cookie_still_gets_a_fresh_session() -> None:
    server = CounterEnv()
    async with await start_server(server) as env, aiohttp.ClientSession() as http:
        status, reply, _ = await post(http, env.url + "/increment", {"amount": 2}, {})
        assert status == 200 and reply == {"count": 2}  # stateless clients keep working
        async with http.get(env.url + "/tools") as t:  # minted here, not stored yet
            minted = t.cookies[server.cookie_name].value
        assert (await post(http, env.url + "/increment", {}, cookie(server, minted)))[0] == 200


async def _restart_mid_flight(n: int, run: Any) -> tuple[Any, RunningServer]:
    """Run ``run(agent_url)`` while the environment restarts between two tool calls of every rollout."""
    env = await start_server(CounterEnv())
    script = [
        {"calls": [{"name": "increment", "arguments": {"amount": 1}}]},
        {"delay_s": 1.0, "calls": [{"name": "increment", "arguments": {"amount": 1}}]},
        "done",
    ]
    model = ScriptedModelServer(script)
    await model.start()
    agent = await start_server(SimpleAgent(resources_url=env.url, model_url=model.url))
    task = asyncio.ensure_future(run(agent.url))
    try:
        for _ in range(400):  # every rollout is inside its second (slow) model call
            if len(model.requests) >= 2 * n:
                break
            await asyncio.sleep(0.01)
        assert len(model.requests) >= 2 * n
        port = env.port
        await env.stop()
        env = await start_server(CounterEnv(), port=port)  # a fresh process: no sessions
        return await task, env
    finally:
        await agent.stop()
        await model.stop()
        await env.stop()


async def test_regression_a_restarted_environment_fails_in_flight_rollouts_as_env_session_lost() -> None:
    rows = [{**r, "target": 2} for r in counter_rows(16)]

    async def run(agent_url: str) -> list[Any]:
        async with GymClient(agent_url, max_attempts=1) as client:
            return [o async for o in client.run_many(rows, concurrency=16, progress=False)]

    outcomes, _ = await _restart_mid_flight(16, run)
    assert len(outcomes) == 16
    assert [o.kind for o in outcomes] == ["env_session_lost"] * 16  # none scored from an empty session
    assert all(o.status == 409 and "restarted" in (o.reason or "") for o in outcomes)


async def test_regression_no_rollout_of_a_restarted_environment_is_trained() -> None:
    rows = [{**r, "target": 2} for r in counter_rows(4)]

    async def run(agent_url: str) -> BridgeIterator:
        client = GymClient(agent_url, max_attempts=1)
        it = BridgeIterator(
            rows,
            GymRollouts(client),
            None,
            BridgeConfig(
                group_size=4, prompts_per_step=4, min_group_size=None, max_consecutive_failed_groups=8
            ),
        )
        try:
            with pytest.raises(BridgeStalledError, match="without a single completed group"):
                await it.__anext__()
        finally:
            await client.aclose()
        return it

    it, _ = await _restart_mid_flight(16, run)
    assert it.stats.failure_classes == {"env_session_lost": 16}
    assert it.stats.batches == 0 and it.stats.rollouts_ok == 0
    rollouts = [f for f in it.failures if f["kind"] == "rollout"]
    assert len(rollouts) == 16 and {f["failure_class"] for f in rollouts} == {"env_session_lost"}
