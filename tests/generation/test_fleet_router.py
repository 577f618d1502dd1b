"""The generator fleet's router (gymbridge.generation.router) over small fake replicas.

Each fake replica is an aiohttp app on loopback that answers with its own index; it can be slowed
down, made to drop connections (a replica that dies mid-call) or to fail its health route.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gymbridge.errors import GeneratorLostError
from gymbridge.generation.router import REPLICA_COOKIE, FleetRouter, ReplicaState

pytestmark = pytest.mark.integration


class FakeReplica:
    """A model-server stand-in: ``POST /v1/responses`` answers ``{"replica": index}``."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.delay_s = 0.0
        self.drop = False
        """Close the connection instead of answering (a replica dying mid-call)."""
        self.healthy = True
        self.calls = 0
        self.paths: list[str] = []
        self.cookies: list[str | None] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _any(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/health":
            return web.json_response({"ok": self.healthy}, status=200 if self.healthy else 503)
        if request.path == "/counters":
            return web.json_response({"compute_busy_s": 0.5 * self.calls, "requests": float(self.calls)})
        body = await request.read()
        self.calls += 1
        self.paths.append(request.path)
        self.cookies.append(request.cookies.get(REPLICA_COOKIE))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.drop:
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(1)
        if request.path.endswith("/echo"):
            digest = hashlib.sha256(body).hexdigest().encode()
            return web.Response(body=digest + b"|" + body[::-1], content_type="application/octet-stream")
        if request.path.endswith("/boom"):
            return web.json_response({"error": "inner"}, status=500)
        resp = web.json_response({"replica": self.index, "path": request.path})
        resp.set_cookie("other", "kept")
        return resp

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._any)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


@pytest.fixture
async def replicas() -> AsyncIterator[list[FakeReplica]]:
    fakes = [FakeReplica(i) for i in range(3)]
    for fake in fakes:
        await fake.start()
    yield fakes
    for fake in fakes:
        await fake.stop()


def jar() -> aiohttp.CookieJar:
    """A client's cookies, as an agent keeps a model server's (``unsafe``: loopback IP addresses)."""
    return aiohttp.CookieJar(unsafe=True)


async def router_over(fakes: list[FakeReplica], **kwargs: Any) -> FleetRouter:
    router = FleetRouter(
        [f.url for f in fakes], initial_state=ReplicaState.HEALTHY, probe_interval_s=0.05, **kwargs
    )
    await router.start()
    return router


async def call(
    http: aiohttp.ClientSession, router: FleetRouter, path: str = "/v1/responses", **kw: Any
) -> tuple[int, Any, aiohttp.ClientResponse]:
    async with http.post(f"{router.url}{path}", json={"input": "hi"}, **kw) as reply:
        body = await reply.json(content_type=None)
        return reply.status, body, reply


async def test_without_a_conversation_calls_go_to_the_least_loaded_replica(
    replicas: list[FakeReplica],
) -> None:
    router = await router_over(replicas)
    for fake in replicas:
        fake.delay_s = 0.5
    try:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
            slow = asyncio.create_task(call(http, router))  # one replica busy with a slow call
            await asyncio.sleep(0.1)
            (busy,) = [r.index for r in router.replicas if r.in_flight]
            for fake in replicas:
                fake.delay_s = 0.0
            answers = [await call(http, router) for _ in range(4)]
            assert (await slow)[1]["replica"] == busy
            # sequential calls never go to the replica still busy, and share the other two
            assert sorted(b["replica"] for _, b, _ in answers[:2]) == sorted({0, 1, 2} - {busy})
            together = await asyncio.gather(*(call(http, router) for _ in range(30)))
    finally:
        await router.stop()
    counts = [sum(b["replica"] == i for _, b, _ in together) for i in range(3)]
    assert all(c >= 6 for c in counts), counts  # spread, not piled on one replica
    assert sum(r.requests for r in router.replicas) == 35


async def test_a_conversation_stays_on_its_replica_through_the_cookie(replicas: list[FakeReplica]) -> None:
    router = await router_over(replicas)
    try:
        conversations = []
        for _ in range(6):  # each conversation a client of its own, as an agent's cookies are per rollout
            async with aiohttp.ClientSession(cookie_jar=jar()) as http:
                seen = [(await call(http, router))[1]["replica"] for _ in range(4)]
            conversations.append(seen)
        async with aiohttp.ClientSession(cookie_jar=jar()) as http:
            _, _, reply = await call(http, router)
            assert reply.cookies["other"].value == "kept"  # the replica's own cookies pass through
    finally:
        await router.stop()
    assert all(len(set(seen)) == 1 for seen in conversations), conversations
    assert len({seen[0] for seen in conversations}) == 3  # and conversations are spread


async def test_a_sticky_conversation_moves_when_its_replica_is_not_healthy(
    replicas: list[FakeReplica],
) -> None:
    router = await router_over(replicas)
    try:
        async with aiohttp.ClientSession(cookie_jar=jar()) as http:
            first = (await call(http, router))[1]["replica"]
            router.set_state(first, ReplicaState.STALE, "test")
            moved = (await call(http, router))[1]["replica"]
            again = (await call(http, router))[1]["replica"]
    finally:
        await router.stop()
    assert moved != first and again == moved


async def test_bodies_pass_through_byte_for_byte(replicas: list[FakeReplica]) -> None:
    router = await router_over(replicas)
    payload = bytes(range(256)) * 40_000  # 10 MB, not JSON
    try:
        async with (
            aiohttp.ClientSession(cookie_jar=jar()) as http,
            http.post(f"{router.url}/ng-rollout/r-1/echo?x=1", data=payload) as reply,
        ):
            data = await reply.read()
    finally:
        await router.stop()
    digest, _, back = data.partition(b"|")
    assert digest == hashlib.sha256(payload).hexdigest().encode() and back == payload[::-1]
    assert any(p == "/ng-rollout/r-1/echo" for f in replicas for p in f.paths)  # prefix kept


async def test_a_call_whose_replica_dies_is_retried_on_another(replicas: list[FakeReplica]) -> None:
    router = await router_over(replicas)
    replicas[0].drop = replicas[1].drop = True
    try:
        async with aiohttp.ClientSession(cookie_jar=jar()) as http:
            answers = [await call(http, router) for _ in range(3)]
    finally:
        await router.stop()
    assert all(status == 200 and body["replica"] == 2 for status, body, _ in answers)
    dropped = router.replicas[0].errors + router.replicas[1].errors
    assert dropped >= 1 and router.replicas[0].retried + router.replicas[1].retried == dropped
    assert ReplicaState.SUSPECT in (router.replicas[0].state, router.replicas[1].state)


async def test_an_answer_a_replica_gave_is_passed_on_not_retried(replicas: list[FakeReplica]) -> None:
    router = await router_over(replicas)
    try:
        async with aiohttp.ClientSession(cookie_jar=jar()) as http:
            status, body, _ = await call(http, router, "/boom")
    finally:
        await router.stop()
    assert status == 500 and body == {"error": "inner"}
    assert sum(f.calls for f in replicas) == 1


async def test_no_healthy_replica_is_a_typed_generator_lost_answer(replicas: list[FakeReplica]) -> None:
    exhausted: list[bool] = []
    router = await router_over(replicas, on_exhausted=lambda: exhausted.append(True))
    for fake in replicas:
        fake.drop = True
    try:
        async with aiohttp.ClientSession(cookie_jar=jar()) as http:
            status, body, reply = await call(http, router)
            for i in range(3):
                router.set_state(i, ReplicaState.DEAD, "test")
            status2, _, reply2 = await call(http, router)
            router.fatal = "below generator.min_healthy=1"
            _, fatal_body, _ = await call(http, router)
    finally:
        await router.stop()
    assert status == 503 and status2 == 503
    for r in (reply, reply2):
        assert r.headers[GeneratorLostError.header] == GeneratorLostError.failure_class
    assert body["type"] == "GeneratorLost" and "lost on replica" in body["message"]
    assert "generator.min_healthy=1" in fatal_body["message"]
    assert router.lost == 3 and exhausted
    assert sum(f.calls for f in replicas) == 3  # one try per replica, then no more


async def test_declaring_a_replica_dead_cancels_its_calls_in_flight(replicas: list[FakeReplica]) -> None:
    router = await router_over(replicas[:2])
    replicas[0].delay_s = 30.0  # hung
    try:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
            hung = asyncio.create_task(call(http, router, cookies={REPLICA_COOKIE: "0"}))
            await asyncio.sleep(0.2)
            assert router.replicas[0].in_flight == 1
            router.set_state(0, ReplicaState.DEAD, "test")
            status, body, _ = await asyncio.wait_for(hung, 5)
    finally:
        await router.stop()
    assert status == 200 and body["replica"] == 1
    assert router.replicas[0].in_flight == 0 and router.replicas[0].retried == 1


async def test_probes_mark_suspect_then_dead_and_a_recovered_replica_healthy(
    replicas: list[FakeReplica],
) -> None:
    dead: list[tuple[int, str]] = []
    router = await router_over(replicas, dead_after_probes=3, on_dead=lambda i, why: dead.append((i, why)))
    try:
        replicas[1].healthy = False
        for _ in range(100):
            await asyncio.sleep(0.02)
            if router.replicas[1].state is not ReplicaState.HEALTHY:
                break
        assert router.replicas[1].state is ReplicaState.SUSPECT
        replicas[1].healthy = True
        for _ in range(100):
            await asyncio.sleep(0.02)
            if router.replicas[1].state is ReplicaState.HEALTHY:
                break
        assert router.replicas[1].state is ReplicaState.HEALTHY
        replicas[2].healthy = False
        for _ in range(200):
            await asyncio.sleep(0.02)
            if dead:
                break
    finally:
        await router.stop()
    assert router.replicas[2].state is ReplicaState.DEAD and dead[0][0] == 2
    assert "health probes failed" in dead[0][1]


async def test_stale_and_restarting_replicas_get_no_calls(replicas: list[FakeReplica]) -> None:
    router = await router_over(replicas)
    router.set_state(0, ReplicaState.STALE)
    router.set_state(1, ReplicaState.RESTARTING)
    try:
        async with aiohttp.ClientSession(cookie_jar=jar()) as http:
            seen = {(await call(http, router))[1]["replica"] for _ in range(5)}
            async with http.get(f"{router.url}/health") as health:
                assert (await health.json())["healthy"] == 1
            async with http.post(f"{router.url}/weights/update", json={}) as weights:
                assert weights.status == 404
    finally:
        await router.stop()
    assert seen == {2}


async def test_counters_are_summed_and_never_go_down_across_a_restart(replicas: list[FakeReplica]) -> None:
    router = await router_over(replicas[:2])
    try:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
            for _ in range(4):
                await call(http, router)
            before = await router.counters()
            replacement = FakeReplica(0)
            await replacement.start()
            router.replace(0, replacement.url)  # a restarted replica: its own counters start at 0
            router.set_state(0, ReplicaState.HEALTHY)
            after = await router.counters()
            async with http.get(f"{router.url}/counters") as reply:
                served = await reply.json()
            await replacement.stop()
    finally:
        await router.stop()
    assert before["requests"] == 4 and before["compute_busy_s"] == 2.0
    assert after["requests"] == 4 and after["replica_0/restarts"] == 1
    assert before["replica_0/requests"] + before["replica_1/requests"] == 4
    assert after["replica_0/state"] == 0 and served["fleet/healthy"] == 2


async def test_through_the_agent_a_rollout_stays_on_one_replica_and_a_lost_one_is_generator_lost() -> None:
    """gymbridge's SimpleAgent sends the router's cookie back on every turn (genuine nemo-gym's
    simple_agent does the same with ``model_response.cookies``): each multi-turn rollout runs on one
    replica; with every replica gone the rollout is a ``generator_lost`` failure, tried once."""
    from gymbridge.client import GymClient
    from gymbridge.server import SimpleAgent, start_server
    from gymbridge.server.examples import CounterEnv, counter_rows
    from gymbridge.testing.scripted_model import ScriptedModelServer

    turn = {"calls": [{"name": "increment", "arguments": {"amount": 1}}]}
    models = [ScriptedModelServer([turn, turn, "done"]) for _ in range(2)]
    urls = [await m.start() for m in models]
    router = FleetRouter(urls, initial_state=ReplicaState.HEALTHY)
    await router.start()
    env = await start_server(CounterEnv())
    agent = await start_server(
        SimpleAgent(resources_url=env.url, model_url=str(router.url), rollout_prefix=True)
    )
    rows = [{**row, "_ng_rollout_index": i} for i, row in enumerate(counter_rows(1) * 8)]
    try:
        async with GymClient(agent.url, backoff_initial_s=0.01) as client:
            outcomes = [o async for o in client.run_many(rows)]
            assert all(o.ok for o in outcomes), [o.reason for o in outcomes]
            for m in models:
                await m.stop()
            lost = await client.run(rows[0])
    finally:
        await agent.stop()
        await env.stop()
        await router.stop()
    placed = {}
    for m in models:
        for path in m.request_paths:
            placed.setdefault(path.split("/")[2], set()).add(id(m))
    assert len(placed) == 8 and all(len(where) == 1 for where in placed.values()), placed
    assert all(len(m.request_paths) >= 3 for m in models)  # both replicas served rollouts
    assert lost.kind == "generator_lost" and lost.attempts == 1 and lost.status == 503
