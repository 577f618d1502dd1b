"""The generator fleet's router: one stable URL in front of N model-server replicas.

Agents (gymbridge's :class:`~gymbridge.server.SimpleAgent`, genuine nemo-gym ones through the Gym
config's ``policy_model``) and the run call :class:`FleetRouter`'s URL as they would call one model
server; every path other than its own (``/health`` and friends, ``/counters``, ``/fleet``) is
forwarded to a **HEALTHY** replica: ``/v1/responses``, ``/v1/chat/completions``, ``/tokenize``,
``/v1/models``, ``/media_cache``, each under an ``/ng-rollout/<id>`` prefix too. ``/weights/*`` is
refused (404): the trainer publishes to each replica itself (:mod:`gymbridge.run.fleet`).

Which replica: the one named by the ``gymbridge_replica`` cookie the router sets on every answer
(both agents send a model server's cookies back on the conversation's next turn, so a
conversation stays on one replica and reuses its prefix cache), else the replica with the fewest
requests in flight (then the fewest served); SUSPECT replicas only when no replica is HEALTHY. A
conversation whose replica is no longer HEALTHY moves to another. The first items of a conversation
are deliberately not hashed: the G rollouts of a group share them, and would all land on one
replica.

Replica states (:class:`ReplicaState`): HEALTHY (served), SUSPECT (a probe or a call failed; no new
calls until a probe answers), DEAD (the process exited, or ``dead_after_probes`` probes in a row
failed; its calls in flight are cancelled at once), RESTARTING, STALE (alive but not holding the
current weights: never served). Only :mod:`gymbridge.run.fleet` moves a replica out of DEAD.

Invariants:

* bodies are passed through as bytes, never parsed or re-encoded; an answer is read whole before
  it is sent on, so a replica that dies mid-answer never yields half an answer;
* a call whose replica died before answering (connection refused or broken, cancelled because the
  replica was declared DEAD) is sent again to another HEALTHY replica, at most once per replica: a
  generation retried from scratch is a fresh sample. When none is left the router answers 503 with
  ``X-Gymbridge-Error: generator_lost`` (:class:`~gymbridge.errors.GeneratorLostError`); an answer a
  replica did give (a 4xx, a 5xx) is passed on as it is;
* per-replica counters (``requests``, ``in_flight``, ``errors``, ``retried``, ``state``, ``restarts``,
  ``policy_version``, ``sync_s``) and the replicas' own counters summed (:meth:`FleetRouter.counters`,
  ``GET /counters``), monotonic across restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict

from gymbridge.errors import GeneratorLostError
from gymbridge.serving import bind_error, check_port

logger = logging.getLogger(__name__)

__all__ = [
    "REPLICA_COOKIE",
    "STATE_CODES",
    "STATE_NAMES",
    "FleetRouter",
    "Replica",
    "ReplicaState",
]

REPLICA_COOKIE = "gymbridge_replica"
"""The cookie that keeps a conversation on its replica (the replica's index)."""

_ROLLOUT_PREFIX = re.compile(r"^/ng-rollout/[^/]+")
_OWN_HEALTH = frozenset({"/", "/health", "/livez", "/healthz", "/readyz"})
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
_MAX_BODY_BYTES = 256 * 1024 * 1024
"""The largest request body forwarded (the model server's own default limit)."""


class ReplicaState(enum.StrEnum):
    """Where a replica stands (module docstring)."""

    HEALTHY = "HEALTHY"
    SUSPECT = "SUSPECT"
    DEAD = "DEAD"
    RESTARTING = "RESTARTING"
    STALE = "STALE"


STATE_CODES: dict[ReplicaState, int] = {
    ReplicaState.HEALTHY: 0,
    ReplicaState.SUSPECT: 1,
    ReplicaState.DEAD: 2,
    ReplicaState.RESTARTING: 3,
    ReplicaState.STALE: 4,
}
"""``replica_<i>/state`` in ``GET /counters`` (numbers only there); :data:`STATE_NAMES` reads them back."""
STATE_NAMES: dict[int, str] = {code: state.value for state, code in STATE_CODES.items()}


@dataclass
class Replica:
    """One model server of the fleet, as the router sees it."""

    index: int
    url: str
    state: ReplicaState = ReplicaState.STALE
    requests: int = 0
    """Calls sent to it (a retried call counts on each replica it went to)."""
    in_flight: int = 0
    errors: int = 0
    """Calls it failed: no answer (it died, or the connection broke) or a 5xx."""
    retried: int = 0
    """Calls it lost that went on to another replica."""
    restarts: int = 0
    probe_failures: int = 0
    policy_version: int = -1
    """The weights' version it holds (-1: none published yet)."""
    sync_s: float = 0.0
    """Seconds its last weight sync took (the slowest replica's is the step's)."""
    reason: str = ""
    """Why it left HEALTHY last."""
    carried: dict[str, float] = field(default_factory=dict)
    """Its earlier processes' counters (so the fleet's sums never go down across a restart)."""
    last_counters: dict[str, float] = field(default_factory=dict)
    attempts: set[asyncio.Task[Any]] = field(default_factory=set)
    """Its calls in flight (cancelled when it is declared DEAD)."""


class _Lost(Exception):
    """The replica did not answer (it died, was declared DEAD, or the connection broke)."""


class FleetRouter:
    """The fleet's router over ``urls`` (module docstring). Replicas start ``initial_state``.

    ``on_dead(index, reason)`` is called (on the event loop) when the probes declare a replica DEAD;
    whoever owns the processes restarts it. ``on_exhausted()`` is called before a call is answered
    ``generator_lost`` (the owner can check its processes, and set :attr:`fatal`, first).
    ``probe_interval_s`` / ``probe_timeout_s`` / ``dead_after_probes`` tune the health probes
    (``GET /health``).
    """

    def __init__(
        self,
        urls: list[str],
        *,
        initial_state: ReplicaState = ReplicaState.STALE,
        probe_interval_s: float = 1.0,
        probe_timeout_s: float = 5.0,
        dead_after_probes: int = 3,
        connect_timeout_s: float = 5.0,
        on_dead: Callable[[int, str], None] | None = None,
        on_exhausted: Callable[[], None] | None = None,
    ) -> None:
        if not urls:
            raise ValueError("a fleet needs at least one replica")
        self.replicas = [Replica(i, u.rstrip("/"), initial_state) for i, u in enumerate(urls)]
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.dead_after_probes = dead_after_probes
        self.connect_timeout_s = connect_timeout_s
        self.on_dead = on_dead
        self.on_exhausted = on_exhausted
        self.fatal: str | None = None
        """Set by the fleet's owner when the run cannot go on (every call then answers generator_lost)."""
        self.lost = 0
        """Calls answered 503 generator_lost."""
        self.url: str | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._probe_task: asyncio.Task[None] | None = None
        self._served = 0

    # ------------------------------------------------------------------ lifecycle

    def app(self) -> web.Application:
        app = web.Application(client_max_size=_MAX_BODY_BYTES)
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on ``host:port`` (0: a free one) and start probing; returns the base URL."""
        check_port(port)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s),
            auto_decompress=False,  # bytes through as the replica sent them
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            await self._session.close()
            raise bind_error(host, port, exc) from exc
        self._runner = runner
        bound = int(runner.addresses[0][1]) if runner.addresses else port
        self.url = f"http://{host}:{bound}"
        self._probe_task = asyncio.create_task(self._probe_loop(), name="gymbridge-fleet-probes")
        logger.info("fleet router on %s over %d replica(s)", self.url, len(self.replicas))
        return self.url

    async def stop(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe_task
            self._probe_task = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> FleetRouter:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ state

    def set_state(self, index: int, state: ReplicaState, reason: str = "") -> None:
        """Move replica ``index`` to ``state`` (on the event loop); DEAD cancels its calls in flight."""
        replica = self.replicas[index]
        if replica.state is state:
            return
        logger.log(
            logging.INFO if state in (ReplicaState.HEALTHY, ReplicaState.STALE) else logging.WARNING,
            "generator replica %d (%s): %s -> %s%s",
            index,
            replica.url,
            replica.state.value,
            state.value,
            f" ({reason})" if reason else "",
        )
        replica.state = state
        if state is not ReplicaState.HEALTHY and reason:
            replica.reason = reason
        if state is ReplicaState.HEALTHY:
            replica.probe_failures = 0
        if state is ReplicaState.DEAD:
            for attempt in list(replica.attempts):
                attempt.cancel()

    def replace(self, index: int, url: str) -> None:
        """Replica ``index`` is a new process at ``url``: STALE until it holds the current weights."""
        replica = self.replicas[index]
        for key, value in replica.last_counters.items():
            replica.carried[key] = replica.carried.get(key, 0.0) + value
        replica.last_counters = {}
        replica.url = url.rstrip("/")
        replica.restarts += 1
        replica.probe_failures = 0
        self.set_state(index, ReplicaState.STALE, "restarted: waiting for the current weights")

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.state is ReplicaState.HEALTHY]

    def describe(self) -> str:
        """Every replica's state in one line (``0 HEALTHY v3, 1 DEAD (exited with -9)``)."""
        return ", ".join(
            f"{r.index} {r.state.value}"
            + (f" v{r.policy_version}" if r.state is ReplicaState.HEALTHY and r.policy_version >= 0 else "")
            + (f" ({r.reason})" if r.state is not ReplicaState.HEALTHY and r.reason else "")
            for r in self.replicas
        )

    # ------------------------------------------------------------------ routing

    def pick(self, sticky: int | None, exclude: set[int]) -> Replica | None:
        """The replica for a call: the sticky one when HEALTHY, else the least loaded HEALTHY one."""
        if sticky is not None and 0 <= sticky < len(self.replicas) and sticky not in exclude:
            replica = self.replicas[sticky]
            if replica.state is ReplicaState.HEALTHY:
                return replica
        candidates = [r for r in self.healthy() if r.index not in exclude]
        if not candidates:  # a SUSPECT replica holds the current weights: better than losing the call
            candidates = [
                r for r in self.replicas if r.state is ReplicaState.SUSPECT and r.index not in exclude
            ]
        if not candidates:
            return None
        self._served += 1
        n = len(self.replicas)
        # fewest in flight, then fewest served; ties rotate so equal replicas share the load
        return min(candidates, key=lambda r: (r.in_flight, r.requests, (r.index - self._served) % n))

    @staticmethod
    def sticky_of(request: web.Request) -> int | None:
        value = request.cookies.get(REPLICA_COOKIE)
        if value is None or not value.isdigit():
            return None
        return int(value)

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        path = _ROLLOUT_PREFIX.sub("", request.path) or "/"
        if request.method == "GET" and path in _OWN_HEALTH:
            return self._health()
        if request.method == "GET" and path == "/counters":
            return web.json_response(await self.counters())
        if request.method == "GET" and path == "/fleet":
            return web.json_response(self.snapshot())
        if path.startswith("/weights/"):
            return _error(
                404,
                "the fleet router does not take weights: the trainer publishes to each replica",
                "NotFoundError",
            )
        return await self._forward(request)

    def _health(self) -> web.Response:
        up = len(self.healthy())
        body = {"status": "ok" if up else "unavailable", "healthy": up, "replicas": len(self.replicas)}
        return web.json_response(body, status=200 if up else 503)

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"the request body is over {_MAX_BODY_BYTES} bytes", "RequestEntityTooLarge")
        headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP)
        sticky = self.sticky_of(request)
        tried: set[int] = set()
        lost: list[str] = []
        while self.fatal is None:
            replica = self.pick(sticky, tried)
            if replica is None:
                break
            tried.add(replica.index)
            try:
                status, reply_headers, data = await self._attempt(replica, request, headers, body)
            except _Lost as exc:
                replica.errors += 1
                lost.append(f"replica {replica.index}: {exc}")
                if self.replicas[replica.index].state is ReplicaState.HEALTHY:
                    self.set_state(replica.index, ReplicaState.SUSPECT, f"a call failed: {exc}")
                continue
            if len(tried) > 1:
                for index in tried - {replica.index}:
                    self.replicas[index].retried += 1
            if status >= 500:
                replica.errors += 1
            response = web.Response(status=status, body=data, headers=reply_headers)
            response.set_cookie(REPLICA_COOKIE, str(replica.index), path="/", httponly=True)
            return response
        self.lost += 1
        if self.on_exhausted is not None and self.fatal is None:
            self.on_exhausted()  # the owner looks at its processes now: the floor may be crossed
        why = self.fatal or (
            f"no healthy replica could take the call ({self.describe()})"
            + (f"; lost on {'; '.join(lost)}" if lost else "")
        )
        logger.warning("%s %s -> 503 generator_lost: %s", request.method, request.path, why)
        return _error(
            503,
            f"generator_lost: {why}",
            "GeneratorLost",
            {GeneratorLostError.header: GeneratorLostError.failure_class},
        )

    async def _attempt(
        self, replica: Replica, request: web.Request, headers: CIMultiDict[str], body: bytes
    ) -> tuple[int, CIMultiDict[str], bytes]:
        """One call to ``replica``: its status, headers and whole body, or :class:`_Lost`."""
        assert self._session is not None, "the router is not started"
        session = self._session
        url = replica.url + request.path_qs

        async def call() -> tuple[int, CIMultiDict[str], bytes]:
            async with session.request(
                request.method, url, headers=headers, data=body or None, allow_redirects=False
            ) as reply:
                data = await reply.read()
                kept = CIMultiDict(
                    (k, v)
                    for k, v in reply.headers.items()
                    if k.lower() not in _HOP_BY_HOP and k.lower() != "set-cookie"
                )
                for cookie in reply.headers.getall("Set-Cookie", []):
                    if not cookie.startswith(f"{REPLICA_COOKIE}="):
                        kept.add("Set-Cookie", cookie)
                return reply.status, kept, data

        replica.requests += 1
        replica.in_flight += 1
        task = asyncio.create_task(call())
        replica.attempts.add(task)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me is not None and me.cancelling():  # our caller went away: so does the call
                task.cancel()
                raise
            raise _Lost(f"declared {replica.state.value} while the call was in flight") from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as exc:
            raise _Lost(f"{type(exc).__name__}: {exc}") from exc
        finally:
            replica.in_flight -= 1
            replica.attempts.discard(task)

    # ------------------------------------------------------------------ probes

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            targets = [r for r in self.replicas if r.state in (ReplicaState.HEALTHY, ReplicaState.SUSPECT)]
            await asyncio.gather(*(self._probe(r) for r in targets))

    async def _probe(self, replica: Replica) -> None:
        assert self._session is not None
        url = replica.url
        try:
            async with self._session.get(
                f"{url}/health", timeout=aiohttp.ClientTimeout(total=self.probe_timeout_s)
            ) as reply:
                await reply.read()
                ok = reply.status == 200
                why = f"health answered {reply.status}"
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            ok, why = False, f"health probe: {type(exc).__name__}: {exc}"
        if replica.url != url or replica.state not in (ReplicaState.HEALTHY, ReplicaState.SUSPECT):
            return  # replaced or declared meanwhile
        if ok:
            replica.probe_failures = 0
            if replica.state is ReplicaState.SUSPECT:
                self.set_state(replica.index, ReplicaState.HEALTHY)
            return
        replica.probe_failures += 1
        if replica.probe_failures >= self.dead_after_probes:
            reason = f"{replica.probe_failures} health probes failed in a row ({why})"
            self.set_state(replica.index, ReplicaState.DEAD, reason)
            if self.on_dead is not None:
                self.on_dead(replica.index, reason)
        elif replica.state is ReplicaState.HEALTHY:
            self.set_state(replica.index, ReplicaState.SUSPECT, why)

    # ------------------------------------------------------------------ counters

    def snapshot(self) -> dict[str, Any]:
        """The fleet now: each replica's state and counters (``GET /fleet``)."""
        return {
            "healthy": len(self.healthy()),
            "lost": self.lost,
            "fatal": self.fatal,
            "replicas": [
                {
                    "index": r.index,
                    "url": r.url,
                    "state": r.state.value,
                    "requests": r.requests,
                    "in_flight": r.in_flight,
                    "errors": r.errors,
                    "retried": r.retried,
                    "restarts": r.restarts,
                    "policy_version": r.policy_version,
                    "sync_s": r.sync_s,
                    "reason": r.reason,
                }
                for r in self.replicas
            ],
        }

    async def counters(self) -> dict[str, float]:
        """The replicas' own counters summed (each replica's earlier processes included), with
        ``replica_<i>/<name>`` for each replica and ``fleet/healthy``, ``fleet/lost``. A replica that
        does not answer keeps its last reading: the sums only grow."""
        alive = [r for r in self.replicas if r.state not in (ReplicaState.DEAD, ReplicaState.RESTARTING)]
        await asyncio.gather(*(self._read_counters(r) for r in alive))
        total: dict[str, float] = {}
        for r in self.replicas:
            for part in (r.carried, r.last_counters):
                for key, value in part.items():
                    total[key] = total.get(key, 0.0) + value
        for r in self.replicas:
            prefix = f"replica_{r.index}/"
            total.update(
                {
                    prefix + "requests": float(r.requests),
                    prefix + "in_flight": float(r.in_flight),
                    prefix + "errors": float(r.errors),
                    prefix + "retried": float(r.retried),
                    prefix + "restarts": float(r.restarts),
                    prefix + "state": float(STATE_CODES[r.state]),
                    prefix + "policy_version": float(r.policy_version),
                    prefix + "sync_s": float(r.sync_s),
                }
            )
        total["fleet/healthy"] = float(len(self.healthy()))
        total["fleet/lost"] = float(self.lost)
        return total

    async def _read_counters(self, replica: Replica) -> None:
        assert self._session is not None
        url = replica.url
        try:
            async with self._session.get(
                f"{url}/counters", timeout=aiohttp.ClientTimeout(total=self.probe_timeout_s)
            ) as reply:
                if reply.status != 200:
                    return
                body = orjson.loads(await reply.read())
        except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError):
            return
        if replica.url == url and isinstance(body, dict):
            replica.last_counters = {
                str(k): float(v)
                for k, v in body.items()
                if isinstance(v, int | float) and not isinstance(v, bool)
            }


def _error(status: int, message: str, kind: str, headers: Mapping[str, str] | None = None) -> web.Response:
    """The model server's error shape (``{"object": "error", ...}``)."""
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return web.Response(
        status=status, body=orjson.dumps(body), content_type="application/json", headers=headers
    )
