"""Session store and cookie handling on the hot path (found while profiling throughput at C=256).

Named regressions: every ``/run`` used to leave a session in the agent's store (and every model
call one in the model server's), so memory grew with the number of rollouts served; once a store
was full, each new session logged one warning line.
"""

from __future__ import annotations

import logging
from http.cookies import SimpleCookie
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from gymbridge.server import ResourcesServer, Session, SimpleAgent, VerifyResult, start_server, tool
from gymbridge.server._http import set_cookie_values
from gymbridge.server.examples import CounterEnv
from gymbridge.testing.scripted_model import ScriptedModelServer


def no_jar() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar())


async def test_regression_agent_and_model_store_no_session_per_rollout() -> None:
    env_server = CounterEnv()
    env = await start_server(env_server)
    script = [{"calls": [{"name": "increment", "arguments": {"amount": 2}}]}, "done"]
    model_server = ScriptedModelServer(script)
    await model_server.start()
    agent_server = SimpleAgent(resources_url=env.url, model_url=model_server.url)
    agent = await start_server(agent_server)
    try:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
            for _ in range(5):
                rcp = {"input": "add 2", "tools": CounterEnv.function_tools()}
                row = {"responses_create_params": rcp, "target": 2}
                async with http.post(agent.url + "/run", json=row) as r:
                    assert r.status == 200 and (await r.json())["reward"] == 1.0
                    # the agent still sets its cookie on every answer (stock parity)
                    assert agent_server.cookie_name in r.cookies
    finally:
        await agent.stop()
        await model_server.stop()
        await env.stop()
    assert agent_server.num_sessions == 0
    assert model_server.num_sessions == 0
    # the environment's sessions are real state, one per rollout; verify ended each rollout
    assert env_server.num_sessions == 0 and env_server.num_finished_sessions == 5


async def test_session_cookie_round_trips_for_an_unstored_session() -> None:
    server = CounterEnv()
    async with await start_server(server) as env, no_jar() as http:
        async with http.get(env.url + "/tools") as r:  # stateless route: cookie set, nothing stored
            sid = r.cookies[server.cookie_name].value
            assert server.num_sessions == 0
            assert "HttpOnly" in r.headers["Set-Cookie"] and "SameSite=Lax" in r.headers["Set-Cookie"]
        headers = {"Cookie": f"{server.cookie_name}={sid}"}
        async with http.post(env.url + "/increment", json={"amount": 3}, headers=headers) as r:
            assert r.cookies[server.cookie_name].value == sid and (await r.json()) == {"count": 3}
        async with http.post(env.url + "/increment", json={"amount": 1}, headers=headers) as r:
            assert (await r.json()) == {"count": 4}  # the session opened on first use is kept
        assert server.num_sessions == 1


async def test_regression_eviction_logs_once_not_per_session(caplog: pytest.LogCaptureFixture) -> None:
    server = CounterEnv(max_sessions=2)
    async with await start_server(server) as env, no_jar() as http:
        with caplog.at_level(logging.WARNING, logger="gymbridge.server._base"):
            for _ in range(10):
                async with http.post(env.url + "/seed_session", json={"start": 1}) as r:
                    assert r.status == 200
    assert server.num_sessions == 2 and server.evicted_sessions == 8
    warnings = [rec for rec in caplog.records if "session store full" in rec.getMessage()]
    assert len(warnings) == 1


COOKIE_TEXT = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E, blacklist_characters=";\\"), max_size=30
)


@given(value=COOKIE_TEXT)
def test_set_cookie_values_matches_simplecookie(value: str) -> None:
    """Any value aiohttp's ``set_cookie`` writes (quoted when needed) reads back as SimpleCookie reads it."""
    response = web.Response()
    response.set_cookie("S___x", value, httponly=True, samesite="Lax")
    line = response.cookies["S___x"].OutputString()
    reference: SimpleCookie = SimpleCookie()
    reference.load(line)
    assert set_cookie_values([line]) == {"S___x": reference["S___x"].value}


def test_set_cookie_values_keeps_starlette_values_and_skips_junk() -> None:
    lines = [
        "A___a=eyJzIjogMX0=.aQx1bA.sig-_; path=/; Max-Age=1209600; httponly; samesite=lax",
        "no-equals-sign",
        "=value-without-name",
        'B___b="quoted value"; Path=/',
        "A___a=later-wins",
    ]
    assert set_cookie_values(lines) == {"A___a": "later-wins", "B___b": "quoted value"}
    assert set_cookie_values(lines[:1]) == {"A___a": "eyJzIjogMX0=.aQx1bA.sig-_"}


class LowercaseHeaderEnv(ResourcesServer):
    """A tool whose parts header arrives lower-cased (as proxies and HTTP/2 hops deliver it)."""

    @tool
    async def look(self, session: Session) -> web.Response:
        """Answer text + an image as parts."""
        parts = [
            {"type": "input_text", "text": "seen"},
            {"type": "input_image", "image_url": "data:image/png;base64,AA==", "detail": "auto"},
        ]
        return web.json_response(parts, headers={"x-gymbridge-tool-output": "parts"})

    async def verify(self, session: Session, row: dict[str, Any], response: dict[str, Any]) -> VerifyResult:
        return VerifyResult(reward=1.0)


async def test_regression_parts_header_is_read_case_insensitively() -> None:
    env = await start_server(LowercaseHeaderEnv())
    model = ScriptedModelServer([{"calls": [{"name": "look", "arguments": {}}]}, "ok"])
    await model.start()
    agent = await start_server(SimpleAgent(resources_url=env.url, model_url=model.url))
    try:
        row = {"responses_create_params": {"input": "look", "tools": LowercaseHeaderEnv.function_tools()}}
        async with aiohttp.ClientSession() as http, http.post(agent.url + "/run", json=row) as r:
            result = await r.json()
    finally:
        await agent.stop()
        await model.stop()
        await env.stop()
    out = result["response"]["output"]
    tool_out = next(o for o in out if o["type"] == "function_call_output")
    assert tool_out["output"] == "seen"
    follow = out[out.index(tool_out) + 1]
    assert follow["role"] == "user" and follow["content"][0]["type"] == "input_image"


def test_tune_gc_for_serving_freezes_startup_objects_and_raises_gen0() -> None:
    """Per-rollout GC work must not grow with concurrency (in-flight objects promoted, rescanned)."""
    import gc

    from gymbridge.server import tune_gc_for_serving

    before = gc.get_threshold()
    try:
        tune_gc_for_serving()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold()[0] >= 20_000 and gc.get_threshold()[1:] == before[1:]
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


async def test_regression_a_long_run_does_not_keep_every_rollouts_session() -> None:
    """The soak of issue 42 found the launcher growing 36 KB a step: the environment kept every
    rollout's session (100,000 before eviction). A verified rollout leaves the store: the newest
    ``finished_sessions`` stay whole, so a repeated verify answers as the first did; for the
    ``finished_ids`` before them a repeated verify is ``env_session_lost`` (409), never a score from
    an empty session."""
    server = CounterEnv()
    server.finished_sessions, server.finished_ids = 3, 4
    verify = {"responses_create_params": {"input": "x"}, "response": {"output": []}, "target": 2}
    cookies: list[dict[str, str]] = []
    async with await start_server(server) as env, no_jar() as http:
        for _ in range(10):
            async with http.post(
                env.url + "/seed_session", json={"responses_create_params": {"input": "x"}}
            ) as r:
                headers = {"Cookie": f"{server.cookie_name}={r.cookies[server.cookie_name].value}"}
            async with http.post(env.url + "/increment", json={"amount": 2}, headers=headers) as r:
                assert (await r.json()) == {"count": 2}
            async with http.post(env.url + "/verify", json=verify, headers=headers) as r:
                assert (await r.json())["reward"] == 0.8
            cookies.append(headers)
        assert server.num_sessions == 0 and server.num_finished_sessions == 3
        async with http.post(env.url + "/verify", json=verify, headers=cookies[-1]) as r:
            assert r.status == 200 and (await r.json())["reward"] == 0.8  # recent: the same answer
        async with http.post(env.url + "/verify", json=verify, headers=cookies[-5]) as r:
            assert r.status == 409 and r.headers["X-Gymbridge-Error"] == "env_session_lost"
        # what is held is bounded: 3 sessions whole, 4 ids, whatever the number of rollouts
        assert (server.num_finished_sessions, len(server._finished_ids), len(server._dropped)) == (3, 4, 0)
