"""Outbound HTTP for servers (the agent): one aiohttp boundary, deadlines, error mapping.

Every call goes through :func:`post_json` / :func:`get`, the only place
aiohttp exceptions are turned into gymbridge errors:

* the deadline (``timeout_s``, covering connect + send + the whole body) passing
  -> :class:`~gymbridge.errors.EnvTimeoutError`. ``timeout_s`` is the only
  deadline: aiohttp's own default (5 min total, 30 s socket connect) is switched
  off per request, so a 600 s model deadline really is 600 s;
* refused / reset / closed mid-body / invalid HTTP -> :class:`~gymbridge.errors.EnvTransportError`
  (``reached=False`` when no connection was established).

A non-2xx status is *not* raised here: callers decide (a tool's 422 is a
model-visible body, a model server's 500 is fatal to the rollout).

Cookies never go through a shared jar: callers pass the exact cookies to send
and get back the ones the server set, so concurrent rollouts cannot see each
other's sessions. ``Set-Cookie`` lines are read by :func:`set_cookie_values`
(name and value only; attributes are irrelevant to forwarding), not through
aiohttp's ``resp.cookies``: that builds a ``SimpleCookie`` with every attribute
per reply and was ~8 % of the agent's CPU per rollout in the throughput profile
(docs/http.md). A quoted value is unquoted exactly as ``SimpleCookie`` does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from http.cookies import SimpleCookie
from typing import Any

import aiohttp
import orjson

from gymbridge.errors import EnvServerError, EnvTimeoutError, EnvTransportError, ProtocolError
from gymbridge.limits import loads_json

__all__ = ["Reply", "cookie_header", "get", "make_client_session", "post_json", "set_cookie_values"]

NO_LIBRARY_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=None)
"""aiohttp's own timeouts off: each call's ``timeout_s`` (``asyncio.timeout``) is its one deadline."""


@dataclass(frozen=True)
class Reply:
    """A server's answer: status, raw body, the cookies it set, its headers (case-insensitive)."""

    url: str
    status: int
    body: bytes
    cookies: dict[str, str]
    headers: Mapping[str, str]

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The parsed body; :class:`ProtocolError` when it is not JSON or nests too deep."""
        try:
            return loads_json(self.body, f"{self.url}: body")
        except ProtocolError as exc:
            raise ProtocolError(f"{exc}: {self.text[:200]!r}") from exc

    def raise_for_status(self) -> None:
        if not self.ok:
            raise EnvServerError(
                f"{self.url} answered HTTP {self.status}: {self.text[:500]}",
                status=self.status,
                body=self.text[:4000],
                server=self.url,
            )


def make_client_session(max_connections: int = 1024) -> aiohttp.ClientSession:
    """A client session with no cookie jar (cookies are forwarded by hand) and a connection cap."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max_connections, limit_per_host=0, force_close=False),
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=NO_LIBRARY_TIMEOUT,
        json_serialize=lambda obj: orjson.dumps(obj).decode(),
    )


def set_cookie_values(lines: Iterable[str]) -> dict[str, str]:
    """``{name: value}`` of ``Set-Cookie`` header lines (later lines win on a name clash).

    The common unquoted ``name=value; attr...`` line is split by hand; a quoted
    value (``name="a b"``) goes through ``SimpleCookie`` so escapes decode as
    aiohttp's ``resp.cookies`` would decode them. Malformed lines are skipped.
    """
    cookies: dict[str, str] = {}
    for line in lines:
        name, sep, rest = line.partition("=")
        name = name.strip()
        if not sep or not name:
            continue
        value = rest.split(";", 1)[0].strip()
        if value.startswith('"'):
            parsed: SimpleCookie = SimpleCookie()
            try:
                parsed.load(line)
            except Exception:  # http.cookies raises CookieError (or worse) on junk: skip the line
                continue
            morsel = parsed.get(name)
            if morsel is None:
                continue
            value = morsel.value
        cookies[name] = value
    return cookies


def cookie_header(*jars: dict[str, str]) -> dict[str, str]:
    """One ``Cookie`` header carrying every jar's cookies (later jars win on a name clash)."""
    merged: dict[str, str] = {}
    for jar in jars:
        merged.update(jar)
    if not merged:
        return {}
    return {"Cookie": "; ".join(f"{k}={v}" for k, v in merged.items())}


async def post_json(
    client: aiohttp.ClientSession,
    url: str,
    payload: Any,
    *,
    timeout_s: float,
    cookies: dict[str, str] | None = None,
) -> Reply:
    """POST ``payload`` (JSON-serialised unless already bytes) to ``url`` with a hard deadline."""
    headers = {"Content-Type": "application/json", **cookie_header(cookies or {})}
    data = payload if isinstance(payload, bytes) else orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)
    return await _request(client, "POST", url, data, headers, timeout_s)


async def get(
    client: aiohttp.ClientSession, url: str, *, timeout_s: float, cookies: dict[str, str] | None = None
) -> Reply:
    """GET ``url`` with a hard deadline."""
    return await _request(client, "GET", url, None, cookie_header(cookies or {}), timeout_s)


async def _request(
    client: aiohttp.ClientSession,
    method: str,
    url: str,
    data: bytes | None,
    headers: dict[str, str],
    timeout_s: float,
) -> Reply:
    try:
        async with asyncio.timeout(timeout_s):
            async with client.request(
                method, url, data=data, headers=headers, timeout=NO_LIBRARY_TIMEOUT
            ) as resp:
                body = await resp.read()
                set_cookies = set_cookie_values(resp.headers.getall("Set-Cookie", ()))
                return Reply(
                    url=url,
                    status=resp.status,
                    body=body,
                    cookies=set_cookies,
                    headers=resp.headers,
                )
    except TimeoutError as exc:
        raise EnvTimeoutError(f"{url}: no complete answer within {timeout_s:g}s", server=url) from exc
    except aiohttp.ClientConnectorError as exc:
        raise EnvTransportError(f"{url}: {type(exc).__name__}: {exc}", server=url, reached=False) from exc
    except (aiohttp.ClientError, OSError) as exc:
        raise EnvTransportError(f"{url}: {type(exc).__name__}: {exc}", server=url, reached=True) from exc
