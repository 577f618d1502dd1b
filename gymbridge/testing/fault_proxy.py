"""FaultProxy: a loopback HTTP proxy in front of a server that injects faults on chosen routes.

Every request is forwarded to ``upstream`` (method, path, body, ``Cookie``; the answer's status,
body, ``Set-Cookie`` and ``X-Gymbridge-*`` headers come back) except those whose path, with any
``/ng-rollout/<id>`` prefix removed, has a :class:`Fault`: that request is answered by the
fault instead, at most ``times`` times (None: always), and counted in ``FaultProxy.injected``.

A fault is an HTTP status (``502``: the proxy answers it with an HTML body, as a gateway does),
``"close_mid_body"`` (a 200 whose ``Content-Length`` promises more than is sent before the
connection closes) or ``"close"`` (the connection closes before any answer).

Usage: ``async with FaultProxy(env.url, {"/zoom": Fault(502)}) as proxy: ... proxy.url ...``.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import aiohttp
from aiohttp import web

__all__ = ["Fault", "FaultProxy"]

_PREFIX = re.compile(r"^/ng-rollout/[^/]+")
_FORWARDED_HEADERS = ("Content-Type", "Cookie")


@dataclass
class Fault:
    """What to answer instead of forwarding: a status, or a connection closed mid-body / at once."""

    kind: int | Literal["close_mid_body", "close"]
    times: int | None = None
    """How many requests get the fault (None: every one); later ones are forwarded."""


class FaultProxy:
    """See the module docstring."""

    def __init__(self, upstream: str, faults: Mapping[str, Fault] | None = None) -> None:
        self.upstream = upstream.rstrip("/")
        self.faults: dict[str, Fault] = dict(faults or {})
        self.injected: collections.Counter[str] = collections.Counter()
        self.forwarded: collections.Counter[str] = collections.Counter()
        self._runner: web.AppRunner | None = None
        self._client: aiohttp.ClientSession | None = None
        self.url = ""

    async def __aenter__(self) -> FaultProxy:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        self._client = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.close()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = _PREFIX.sub("", request.path) or "/"
        fault = self.faults.get(path)
        if fault is not None and (fault.times is None or self.injected[path] < fault.times):
            self.injected[path] += 1
            return await self._inject(request, fault)
        self.forwarded[path] += 1
        assert self._client is not None
        headers = {k: request.headers[k] for k in _FORWARDED_HEADERS if k in request.headers}
        async with self._client.request(
            request.method, self.upstream + request.path_qs, data=await request.read(), headers=headers
        ) as upstream:
            body = await upstream.read()
            reply = web.Response(status=upstream.status, body=body)
            for name, value in upstream.headers.items():
                if name.lower() == "set-cookie" or name.lower().startswith("x-gymbridge"):
                    reply.headers.add(name, value)
            if "Content-Type" in upstream.headers:
                reply.headers["Content-Type"] = upstream.headers["Content-Type"]
            return reply

    @staticmethod
    async def _inject(request: web.Request, fault: Fault) -> web.StreamResponse:
        await request.read()
        if isinstance(fault.kind, int):
            text = f"<html><body><h1>{fault.kind} injected by FaultProxy</h1></body></html>"
            return web.Response(status=fault.kind, text=text, content_type="text/html")
        transport = request.transport
        if fault.kind == "close":
            if transport is not None:
                transport.close()
            return web.Response(status=204)  # never sent: the connection is gone
        reply = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        reply.content_length = 4096
        await reply.prepare(request)
        await reply.write(b'{"partial": "the connection closes before the rest')
        if transport is not None:
            transport.close()
        return reply
