"""Reliability over loopback (issue 5 section 5): hangs, flaky 5xx, 4xx, garbage, broken bodies, 200 rollouts.

Every server here is real (aiohttp or raw asyncio on 127.0.0.1), so these
exercise the actual socket paths: deadlines cancel in-flight requests,
retries are bounded, and every row is accounted for.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import yaml
from aiohttp import web

from gymbridge.client import GymClient
from gymbridge.server import SimpleAgent, example_arguments, start_server
from gymbridge.server.examples import CounterEnv, counter_rows
from gymbridge.testing.scripted_model import ScriptedModelServer, call_index

logger = logging.getLogger(__name__)

ROW = counter_rows(1)[0]
FAST = {"backoff_initial_s": 0.01, "backoff_max_s": 0.05}


@asynccontextmanager
async def agent_stub(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/run", handler)
    running = await start_server(app)
    try:
        yield running.url
    finally:
        await running.stop()


async def test_hanging_server_times_out_at_the_deadline() -> None:
    cancelled = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()  # the client's deadline closed the connection: the server stops working too
            raise
        return web.json_response({})  # pragma: no cover

    async with agent_stub(hang) as url, GymClient(url, deadline_s=0.5, **FAST) as client:
        started = time.monotonic()
        outcome = await client.run(ROW)
        elapsed = time.monotonic() - started
        await asyncio.wait_for(cancelled.wait(), timeout=5)
    assert outcome.kind == "timeout" and outcome.attempts == 1
    assert 0.45 < elapsed < 60  # wallclock-ok: not before the 0.5 s deadline, far before the 3600 s hang
    assert "deadline of 0.5s" in (outcome.reason or "")


async def test_500_then_200_is_retried_and_succeeds() -> None:
    calls = 0

    async def flaky(request: web.Request) -> web.Response:
        nonlocal calls
        calls += 1
        row = await request.json()
        if calls == 1:
            return web.json_response(
                "Hit an exception in SimpleAgent___a calling an inner server: boom", status=500
            )
        return web.json_response({**row, "response": {"output": []}, "reward": 0.5})

    async with agent_stub(flaky) as url, GymClient(url, **FAST) as client:
        outcome = await client.run(ROW)
    assert outcome.ok and outcome.reward == 0.5 and outcome.attempts == 2 and calls == 2


@pytest.mark.parametrize(
    ("status", "body"),
    [(400, b'{"detail": "bad"}'), (422, b'{"detail": []}'), (200, b"{garbage"), (200, b'"just a string"')],
)
async def test_4xx_and_garbage_are_data_failures_not_retried(status: int, body: bytes) -> None:
    calls = 0

    async def answer(request: web.Request) -> web.Response:
        nonlocal calls
        calls += 1
        return web.Response(status=status, body=body, content_type="application/json")

    async with agent_stub(answer) as url, GymClient(url, max_attempts=5, **FAST) as client:
        outcome = await client.run(ROW)
    assert outcome.kind == "data" and outcome.attempts == 1 and calls == 1


async def test_connection_closed_mid_body_is_infra_and_bounded() -> None:
    connections = 0

    async def truncated(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n{"rew'
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(truncated, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with GymClient(f"http://127.0.0.1:{port}", max_attempts=3, **FAST) as client:
            outcome = await client.run(ROW)
    finally:
        server.close()
        await server.wait_closed()
    assert outcome.kind == "infra" and outcome.attempts == 3 and connections == 3
    reason = outcome.reason or ""
    assert any(
        name in reason for name in ("ClientPayloadError", "ServerDisconnectedError", "RemoteProtocolError")
    )


async def test_connection_refused_is_infra() -> None:
    async with GymClient("http://127.0.0.1:9", max_attempts=2, **FAST) as client:
        outcome = await client.run(ROW)
    assert outcome.kind == "infra" and outcome.attempts == 2


@pytest.mark.timeout(900)
async def test_200_concurrent_rollouts_through_the_agent_every_row_accounted(
    record_property: Callable[[str, object], None],
) -> None:
    n = 200
    script = [
        {"reasoning": "go", "calls": [{"name": "increment", "arguments": {"amount": 1}}]},
        {"calls": [{"name": "snapshot", "arguments": {}}]},
        "done",
    ]
    rows = counter_rows(n, seed=7)
    env = await start_server(CounterEnv())
    model = ScriptedModelServer(script, keep_requests=False)
    await model.start()
    agent = await start_server(SimpleAgent(resources_url=env.url, model_url=model.url))
    tracemalloc.start()
    started = time.monotonic()
    try:
        # hang guards, not budgets: 200 rows share one event loop (4 min on a loaded 2-core machine;
        # 200 connections waited over 10 s to be accepted)
        async with GymClient(agent.url, deadline_s=600, connect_timeout_s=600, **FAST) as client:
            outcomes = [o async for o in client.run_many(rows, concurrency=n, progress=False)]
    finally:
        elapsed = time.monotonic() - started
        _, peak_traced = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        await agent.stop()
        await model.stop()
        await env.stop()
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    record_property("elapsed_s", round(elapsed, 2))
    record_property("peak_traced_mib", round(peak_traced / 2**20, 1))
    record_property("peak_rss_mib", round(peak_rss_mib))
    logger.info(
        "200 concurrent rollouts: %.2fs, peak traced %.1f MiB, peak RSS %.0f MiB",
        elapsed,
        peak_traced / 2**20,
        peak_rss_mib,
    )
    assert sorted(o.index for o in outcomes) == list(range(n))
    assert all(o.ok for o in outcomes), [o.reason for o in outcomes if not o.ok][:3]
    assert model.num_calls == 3 * n
    # target is 1..3 and the script increments once: reward 1.0 exactly when target == 1
    for o in outcomes:
        assert o.reward == pytest.approx(1.0 if o.row["target"] == 1 else 0.2)
        assert [x["type"] for x in o.result["response"]["output"]].count("function_call_output") == 2  # type: ignore[index]
    assert peak_traced < 256 * 2**20, f"peak traced Python memory {peak_traced / 2**20:.0f} MiB"


@pytest.mark.timeout(900)
async def test_200_concurrent_rollouts_across_example_environments_via_head_discovery() -> None:
    """Three example environments behind three agents; rows routed by agent_ref via a head server."""
    registry = pytest.importorskip("gymbridge_envs.registry")

    plan = {"circle_click": 70, "counter": 70, "grid_door": 60}

    def script(request: dict[str, Any]) -> dict[str, Any]:
        tools = request.get("tools") or []
        if not tools:
            return {"text": "<action>up</action>"}
        if call_index(request) == 0:
            tool = tools[0]
            return {"calls": [{"name": tool["name"], "arguments": example_arguments(tool["parameters"])}]}
        return {"text": "done"}

    model = ScriptedModelServer(script, keep_requests=False)
    await model.start()
    started: list[Any] = []
    config: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    try:
        for name in plan:
            spec = registry.get_env(name)
            env = await start_server(spec.make_server())
            agent = await start_server(
                SimpleAgent(resources_url=env.url, model_url=model.url, gymnasium=spec.style == "gymnasium")
            )
            started += [agent, env]
            config[f"{name}_agent"] = {
                "responses_api_agents": {"simple_agent": {"host": "0.0.0.0", "port": agent.port}}
            }
            for row in spec.generate(plan[name], seed=3):
                rows.append({**row, "agent_ref": {"type": "responses_api_agents", "name": f"{name}_agent"}})

        async def config_yaml(_: web.Request) -> web.Response:
            return web.json_response(yaml.safe_dump(config))

        head_app = web.Application()
        head_app.router.add_get("/global_config_dict_yaml", config_yaml)
        head = await start_server(head_app)
        started.append(head)
        # hang guards, as above
        async with GymClient(head_url=head.url, deadline_s=600, connect_timeout_s=600, **FAST) as client:
            outcomes = [o async for o in client.run_many(rows, concurrency=200, progress=False)]
    finally:
        for server in reversed(started):
            await server.stop()
        await model.stop()
    assert sorted(o.index for o in outcomes) == list(range(len(rows)))
    failed = [(o.row["agent_ref"]["name"], o.kind, o.reason) for o in outcomes if not o.ok]
    assert not failed, failed[:3]
    by_agent = {
        name: sum(1 for o in outcomes if o.agent_url and o.row["agent_ref"]["name"] == f"{name}_agent")
        for name in plan
    }
    assert by_agent == plan
