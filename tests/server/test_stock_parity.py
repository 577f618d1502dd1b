"""Protocol parity with stock NeMo Gym, both ways, using fixtures in Gym's exact JSON shapes.

* a stock agent's request sequence (``fixtures/stock_simple_agent_exchange.json``)
  drives our resources server and gets stock-shaped answers;
* our agent drives a stock-shaped resources server (a FastAPI-like stub that
  sets a Starlette session cookie) and forwards cookies the way Gym does:
  per server for tool calls, all together in one header for ``/verify``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from gymbridge.server import SimpleAgent, start_server
from gymbridge.server.examples import CounterEnv
from gymbridge.testing.scripted_model import ScriptedModelServer

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "stock_simple_agent_exchange.json").read_text())
# the fields stock BaseVerifyResponse / NeMoGymResponse require
VERIFY_REQUIRED = {"responses_create_params", "response", "reward"}
RESPONSE_REQUIRED = {
    "id",
    "created_at",
    "model",
    "object",
    "output",
    "parallel_tool_calls",
    "tool_choice",
    "tools",
}


async def test_stock_agent_sequence_drives_our_server() -> None:
    row = FIXTURE["row"]
    async with (
        await start_server(CounterEnv(instance_name="counter")) as env,
        aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http,
    ):
        async with http.post(env.url + "/seed_session", json=row) as resp:
            assert resp.status == 200 and await resp.json() == {}
            cookie = resp.cookies["CounterEnv___counter"].value
        # stock simple_agent forwards the cookies it received, plus whatever came to /run
        header = {"Cookie": f"SimpleAgent___counter_simple_agent=opaque; CounterEnv___counter={cookie}"}
        for name, args in FIXTURE["tool_calls"]:
            async with http.post(f"{env.url}/{name}", json=args, headers=header) as resp:
                assert resp.status == 200
                last_tool = await resp.text()
        assert json.loads(last_tool) == {"count": 2}
        async with http.post(
            env.url + "/verify", json={**row, "response": FIXTURE["response"]}, headers=header
        ) as r:
            assert r.status == 200
            verify = await r.json()
    assert set(verify) >= VERIFY_REQUIRED
    assert set(verify["response"]) >= RESPONSE_REQUIRED
    assert verify["reward"] == 1.0 and isinstance(verify["reward"], float)
    assert verify["responses_create_params"] == row["responses_create_params"]
    assert verify["response"]["output"][-1]["generation_token_ids"] == [4, 5]


def stock_resources_stub(log: list[tuple[str, str, Any]]) -> web.Application:
    """A stand-in for a genuine FastAPI resources server (circle_click-like)."""
    cookie_name = "CircleClickResourcesServer___circle_click"
    starlette_value = "eyJzZXNzaW9uX2lkIjogIjlmMWMifQ==.aQx1bA.zKp3-sig_value"

    async def handle(request: web.Request) -> web.Response:
        body = await request.json()
        log.append((request.path, request.headers.get("Cookie", ""), body))
        if request.path == "/seed_session":
            resp = web.json_response({})
        elif request.path == "/click":
            if not isinstance(body.get("x"), int):
                return web.json_response(
                    {"detail": [{"type": "int_parsing", "loc": ["body", "x"], "msg": "bad"}]}, status=422
                )
            resp = web.json_response({"x": body["x"], "y": body["y"]})
        else:
            resp = web.json_response({**body, "reward": 1.0, "mask_sample": False, "failure_kind": None})
        resp.set_cookie(cookie_name, starlette_value, httponly=True, samesite="lax", max_age=1209600)
        return resp

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    for path in ("/seed_session", "/click", "/verify"):
        app.router.add_post(path, handle)
    app.router.add_get("/", health)
    return app


async def test_our_agent_drives_a_stock_resources_server() -> None:
    log: list[tuple[str, str, Any]] = []
    env = await start_server(stock_resources_stub(log))
    model = ScriptedModelServer([{"calls": [{"name": "click", "arguments": {"x": 3, "y": 4}}]}, "clicked"])
    await model.start()
    agent = await start_server(
        SimpleAgent(resources_url=env.url, model_url=model.url, instance_name="cc_agent")
    )
    click = {"type": "function", "name": "click", "parameters": {"type": "object", "properties": {}}}
    row = {
        "responses_create_params": {"input": "click the red circle", "tools": [click]},
        "circles": [],
        "target_color": "red",
    }
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.post(agent.url + "/run", json=row, headers={"Cookie": "Caller___head=abc"}) as resp,
        ):
            assert resp.status == 200
            result = await resp.json()
    finally:
        await agent.stop()
        await model.stop()
        await env.stop()
    paths = [p for p, _, _ in log]
    assert paths == ["/seed_session", "/click", "/verify"]
    assert log[0][2] == row  # seed gets the whole row
    resources_cookie = (
        "CircleClickResourcesServer___circle_click=eyJzZXNzaW9uX2lkIjogIjlmMWMifQ==.aQx1bA.zKp3-sig_value"
    )
    assert resources_cookie in log[1][1]  # the tool call carries the resources session
    verify_cookie = log[2][1]
    # one header, all three: the caller's, the resources server's and the model server's
    assert "Caller___head=abc" in verify_cookie
    assert resources_cookie in verify_cookie
    assert "ScriptedModelServer___policy_model=" in verify_cookie
    assert result["reward"] == 1.0 and result["circles"] == []
    assert [o["type"] for o in result["response"]["output"]] == [
        "function_call",
        "function_call_output",
        "message",
    ]
    assert json.loads(result["response"]["output"][1]["output"]) == {"x": 3, "y": 4}
