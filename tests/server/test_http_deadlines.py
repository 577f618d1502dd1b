"""The agent's outbound HTTP boundary (``gymbridge.server._http``): one deadline per call, errors mapped."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from gymbridge.errors import EnvTimeoutError, EnvTransportError
from gymbridge.server import start_server
from gymbridge.server._http import make_client_session, post_json


async def slow_app(delay_s: float) -> web.Application:
    async def handler(request: web.Request) -> web.Response:
        await asyncio.sleep(delay_s)
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/slow", handler)
    return app


async def test_per_call_deadline_is_not_capped_by_aiohttp_default_timeout_regression() -> None:
    """Regression (issue 5 review): aiohttp's session default (300 s total) silently capped the
    agent's 600 s ``model_timeout_s``. The per-call ``timeout_s`` must be the only deadline."""
    async with await start_server(await slow_app(0.5)) as server:
        # a session whose library default is shorter than the call's deadline
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.1)) as short_default:
            reply = await post_json(short_default, server.url + "/slow", {}, timeout_s=5)
        assert reply.status == 200 and reply.json() == {"ok": True}
    async with await start_server(await slow_app(3600)) as never, make_client_session() as client:
        assert client.timeout.total is None and client.timeout.sock_connect is None
        started = time.monotonic()
        with pytest.raises(EnvTimeoutError):
            await post_json(client, never.url + "/slow", {}, timeout_s=0.1)
        # the deadline fired: the server answers after an hour
        assert time.monotonic() - started < 60  # wallclock-ok: 600x the deadline, 1/60 of the answer


async def test_refused_connection_is_a_transport_error() -> None:
    async with make_client_session() as client:
        with pytest.raises(EnvTransportError):
            await post_json(client, "http://127.0.0.1:9/x", {}, timeout_s=2)
