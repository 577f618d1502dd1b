"""The HTTP core every gymbridge server shares: routing, sessions, health, error bodies.

A :class:`GymServer` owns one ``aiohttp.web.Application`` whose single catch-all
route dispatches on ``(method, path)`` after stripping a ``/ng-rollout/<id>``
prefix, so prefixed and bare paths reach the same handler.

Invariants:

* every server answers ``GET /``, ``/livez``, ``/healthz``, ``/readyz`` and
  ``/health`` with ``{"status": "ok"}``;
* sessions live in a cookie named ``<ServerClass>___<instance>`` (NeMo Gym's
  name); a server reads only its own cookie, so many servers' cookies may
  travel together in one ``Cookie`` header; every response (re)sets it;
* the session store is bounded (``max_sessions``; least recently used evicted
  first, logged on the first eviction and every 10,000th), so a client that
  never closes sessions cannot grow memory without bound; a session enters the
  store only when a handler uses it (``ctx.session``), so stateless routes (an
  agent's ``/run``, a model call) store nothing per request;
* a finished session (``verify`` answered: the rollout's last call) leaves the store
  (:meth:`GymServer.finish_session`): the newest ``finished_sessions`` (1,024) are kept,
  state and all, so a repeated ``verify`` answers as the first did; the ids of the
  ``finished_ids`` (16,384) before them are remembered, so continuing one is
  ``env_session_lost``. A long run's server holds the rollouts in flight and a fixed
  number of finished ones, not every rollout it ever served (stock servers keep them
  until ``close_session``);
* a handler is cancelled when its client disconnects (``handler_cancellation``),
  so a caller's deadline also stops the work it started downstream;
* a call that continues a session (``RequestContext.existing_session``: tool calls,
  ``verify``, ``step``) with a cookie this server cannot continue answers 409 with
  ``X-Gymbridge-Error: env_session_lost``, never a fresh empty session. Minted ids
  are ``<token>.<HMAC under a per-instance key>``, so "not stored yet" (minted here,
  first use opens it) is told apart from "unknown" (minted by an earlier incarnation,
  i.e. before a restart, or by someone else) and from "evicted" (the last ``max_sessions``
  evicted ids are remembered). A session the client closed (``close_session``) is not an
  error to continue: it starts afresh, as stock Gym does;
* no request kills the server: unknown paths answer 404, wrong methods 405,
  malformed JSON or JSON nested deeper than ``gymbridge.limits.MAX_JSON_DEPTH``
  400, and an unexpected exception in a handler becomes a 500
  whose body is a JSON string (``repr`` of the exception), as stock Gym does.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import hmac
import logging
import re
import secrets
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from gymbridge.errors import EnvFaultError, EnvSessionLostError, ProtocolError
from gymbridge.limits import loads_json
from gymbridge.serving import (
    MAX_PORT,
    bind_error,
    check_port,
    free_port,
    probe_port,
    serve_until_stopped,
)

__all__ = [
    "ERROR_HEADER",
    "MAX_BODY_BYTES",
    "MAX_PORT",
    "RESERVED_TOOL_NAMES",
    "SESSION_LOST",
    "GymServer",
    "HttpError",
    "RequestContext",
    "RunningServer",
    "Session",
    "bind_error",
    "check_port",
    "free_port",
    "json_response",
    "probe_port",
    "serve",
    "serve_until_stopped",
    "start_server",
    "tune_gc_for_serving",
]

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 256 * 1024 * 1024
"""Request body cap: verify payloads carry every turn's images as data URLs."""

ROLLOUT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
"""Stock Gym's rollout-id pattern (a path segment and a file-name component)."""
ROLLOUT_PREFIX = re.compile(rf"^/ng-rollout/(?P<rollout_id>{ROLLOUT_ID.pattern.strip('^$')})(?P<rest>/.*)?$")
HEALTH_PATHS = ("/", "/livez", "/healthz", "/readyz", "/health")
RESERVED_TOOL_NAMES = frozenset(
    {
        "seed_session",
        "verify",
        "close_session",
        "aggregate_metrics",
        "reset",
        "step",
        "close",
        "tools",
        "run",
        *(p.strip("/") for p in HEALTH_PATHS),
    }
)
"""Protocol routes no tool may take: the SDK refuses to register them, agents refuse to call them
(a model that calls ``seed_session`` or ``verify`` as a tool could set its own reward or read the
answer). ``""`` stands for ``/``."""
SESSION_LOST = EnvSessionLostError.failure_class
"""Failure class (and ``X-Gymbridge-Error`` value) of a request whose session the server does not know."""
ERROR_HEADER = EnvSessionLostError.header
COOKIE_VALUE = re.compile(r"^[A-Za-z0-9_.~-]+$")
"""A session id that needs no quoting in ``Set-Cookie`` (every id this server mints)."""
COOKIE_ATTRIBUTES = "; HttpOnly; Path=/; SameSite=Lax"
EVICTION_LOG_EVERY = 10_000


class HttpError(Exception):
    """Raised by a handler to answer with ``status``, a JSON ``payload`` and optional ``headers``."""

    def __init__(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        super().__init__(f"HTTP {status}: {payload!r}")
        self.status = status
        self.payload = payload
        self.headers = headers


@dataclass
class Session:
    """Per-session state a server keeps between calls of one rollout."""

    id: str
    state: dict[str, Any] = field(default_factory=dict)
    faults: list[EnvFaultError] = field(default_factory=list)
    """Environment faults the session's tools answered (``gymbridge.faults``); ``verify`` masks the result."""


class RequestContext:
    """What a route handler sees: the request, its session, its parsed path.

    ``session_id`` is the request's own cookie value, else a fresh id; the
    :attr:`session` itself is opened (and stored) on first access, so a handler
    that never looks at it (an agent's ``/run``, a model call) leaves nothing in
    the session store. An unopened session and a stored empty one behave alike
    to the client: the same cookie comes back either way.
    """

    __slots__ = (
        "_body",
        "_known",
        "_open",
        "_session",
        "cookie_given",
        "path",
        "request",
        "rollout_id",
        "session_id",
    )

    def __init__(
        self,
        request: web.Request,
        path: str,
        rollout_id: str | None,
        session_id: str,
        open_session: Callable[[str], Session] | None = None,
        *,
        cookie_given: bool = False,
        known_session: Callable[[str], bool] | None = None,
    ) -> None:
        self.request = request
        self.path = path
        self.rollout_id = rollout_id
        self.session_id = session_id
        self.cookie_given = cookie_given
        """True when the request carried this server's session cookie (False: a fresh id was minted)."""
        self._open = open_session
        self._known = known_session
        self._session: Session | None = None
        self._body: bytes | None = None

    @property
    def session(self) -> Session:
        """This request's session (created in the server's store on first access)."""
        if self._session is None:
            self._session = self._open(self.session_id) if self._open else Session(id=self.session_id)
        return self._session

    def existing_session(self) -> Session:
        """The session of a call that continues one (a tool call, ``verify``, ``step``).

        A request without a cookie gets a fresh session (stateless clients, stock
        behaviour); a cookie the server does not know (it restarted or evicted
        the session) answers 409 ``env_session_lost``: answering from a fresh empty
        session would score a rollout against state it never had.
        """
        known = self._known
        if self._session is None and self.cookie_given and known is not None and not known(self.session_id):
            raise HttpError(
                409,
                {
                    "detail": (
                        f"unknown session {self.session_id[:64]!r}: this server holds no session for "
                        "the cookie (it restarted or evicted the session); "
                        "start a new rollout with seed_session or reset"
                    ),
                    "error": SESSION_LOST,
                },
                headers={ERROR_HEADER: SESSION_LOST},
            )
        return self.session

    async def body_bytes(self) -> bytes:
        if self._body is None:
            self._body = await self.request.read()
        return self._body

    async def json(self) -> Any:
        """The JSON body; a malformed one answers 400 with a JSON error."""
        raw = await self.body_bytes()
        if not raw.strip():
            raise HttpError(400, {"detail": "request body is empty; expected JSON"})
        try:
            return loads_json(raw, "request body")
        except ProtocolError as exc:
            raise HttpError(400, {"detail": str(exc)}) from None

    async def json_object(self) -> dict[str, Any]:
        """The JSON body, which must be an object (422 otherwise, as FastAPI answers)."""
        body = await self.json()
        if not isinstance(body, dict):
            raise HttpError(
                422,
                {
                    "detail": [
                        {"type": "dict_type", "loc": ["body"], "msg": "Input should be a valid dictionary"}
                    ]
                },
            )
        return body


Handler = Callable[[RequestContext], Awaitable[web.StreamResponse]]


def json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON response serialised with orjson (non-str keys and numpy scalars are refused loudly)."""
    return web.Response(
        body=orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY),
        status=status,
        content_type="application/json",
        headers=headers,
    )


class GymServer:
    """Base of every gymbridge HTTP server (resources server, agent, scripted model).

    Subclasses register routes with :meth:`add_route` in ``__init__``; they
    never touch aiohttp routing directly.
    """

    def __init__(self, *, instance_name: str | None = None, max_sessions: int = 100_000) -> None:
        self.instance_name = instance_name or type(self).__name__
        self.max_sessions = max_sessions
        self._routes: dict[str, dict[str, Handler]] = {}
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        # Minted session ids carry an HMAC under this instance's key, so a cookie minted by an earlier
        # incarnation (a restart) or another server is told apart from one minted here but not stored yet.
        self._session_key = secrets.token_bytes(16)
        self._finished: OrderedDict[str, Session] = OrderedDict()
        """Sessions whose rollout ended (:meth:`finish_session`), the newest ``finished_sessions``."""
        self._finished_ids: OrderedDict[str, None] = OrderedDict()
        """Ids of finished sessions no longer kept whole, the newest ``finished_ids``."""
        self._dropped: OrderedDict[str, None] = OrderedDict()
        """Ids evicted from the full store (the last ``max_sessions``): continuing one is
        ``env_session_lost``. A session its client closed is not remembered: the client ended it."""
        self.evicted_sessions = 0
        """Sessions dropped because the store was full (logged on the first and every 10,000th)."""
        for path in HEALTH_PATHS:
            self.add_route("GET", path, self._health)

    # ---------------------------------------------------------------- routing
    @property
    def cookie_name(self) -> str:
        """NeMo Gym's session cookie name: ``<ServerClass>___<instance>``."""
        return f"{type(self).__name__}___{self.instance_name}"

    def add_route(self, method: str, path: str, handler: Handler) -> None:
        self._routes.setdefault(path, {})[method.upper()] = handler

    def routes(self) -> dict[str, list[str]]:
        """Every served path and its methods (for docs and conformance checks)."""
        return {path: sorted(methods) for path, methods in self._routes.items()}

    def make_app(self) -> web.Application:
        """A fresh ``aiohttp`` application serving this server."""
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def on_startup(self) -> None:
        """Hook: open outbound clients etc. (runs inside the serving loop)."""

    async def on_cleanup(self) -> None:
        """Hook: close what :meth:`on_startup` opened."""

    async def _on_startup(self, _app: web.Application) -> None:
        await self.on_startup()

    async def _on_cleanup(self, _app: web.Application) -> None:
        await self.on_cleanup()

    # --------------------------------------------------------------- sessions
    def session(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    finished_sessions = 1024
    """Finished sessions kept whole (:meth:`finish_session`)."""
    finished_ids = 16_384
    """Ids of older finished sessions remembered (continuing one is ``env_session_lost``)."""

    def drop_session(self, session_id: str) -> bool:
        """Forget a session its client closed (a later call with its cookie starts afresh, as stock)."""
        finished = self._finished.pop(session_id, None) is not None
        return self._sessions.pop(session_id, None) is not None or finished

    def finish_session(self, session_id: str) -> None:
        """The rollout of ``session_id`` ended: move it out of the store, to the newest
        :attr:`finished_sessions` (a repeated last call still finds it); an older finished one
        keeps only its id (the newest :attr:`finished_ids`): continuing it is
        ``env_session_lost``."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return
        self._finished[session_id] = session
        while len(self._finished) > self.finished_sessions:
            old, _ = self._finished.popitem(last=False)
            self._finished_ids[old] = None
            while len(self._finished_ids) > self.finished_ids:
                self._finished_ids.popitem(last=False)

    def _remember_dropped(self, session_id: str) -> None:
        self._dropped[session_id] = None
        while len(self._dropped) > self.max_sessions:
            self._dropped.popitem(last=False)

    def _mint_session_id(self) -> str:
        token = secrets.token_urlsafe(18)
        return f"{token}.{self._sign(token)}"

    def _sign(self, token: str) -> str:
        return hmac.new(self._session_key, token.encode(), hashlib.sha256).hexdigest()[:20]

    def session_usable(self, session_id: str) -> bool:
        """True when a call may continue ``session_id``: it is stored, or this instance minted
        it and never evicted it (a session enters the store on first use)."""
        if session_id in self._sessions or session_id in self._finished:
            return True
        token, _, sig = session_id.rpartition(".")
        return (
            bool(token)
            and hmac.compare_digest(sig, self._sign(token))
            and session_id not in self._dropped
            and session_id not in self._finished_ids
        )

    @property
    def num_sessions(self) -> int:
        """Sessions in the store: those of rollouts not finished."""
        return len(self._sessions)

    @property
    def num_finished_sessions(self) -> int:
        """Finished sessions kept (at most :attr:`finished_sessions`)."""
        return len(self._finished)

    def _open_session(self, session_id: str) -> Session:
        """The stored session ``session_id`` (most recently used now), created when absent."""
        found = self._sessions.get(session_id)
        if found is not None:
            self._sessions.move_to_end(session_id)
            return found
        found = self._finished.pop(session_id, None)
        if found is not None:  # a finished session called again: back in the store
            self._sessions[session_id] = found
            return found
        session = Session(id=session_id)
        self._sessions[session_id] = session
        self._dropped.pop(session_id, None)
        self._finished_ids.pop(session_id, None)
        while len(self._sessions) > self.max_sessions:
            evicted, _ = self._sessions.popitem(last=False)
            self._remember_dropped(evicted)
            self.evicted_sessions += 1
            # Once full, every new session evicts one: a line per eviction would flood the log.
            if self.evicted_sessions == 1 or self.evicted_sessions % EVICTION_LOG_EVERY == 0:
                logger.warning(
                    "%s: session store full (%d); evicted session %s (%d evicted so far, oldest first)",
                    self.cookie_name,
                    self.max_sessions,
                    evicted,
                    self.evicted_sessions,
                )
        return session

    # --------------------------------------------------------------- dispatch
    async def _health(self, ctx: RequestContext) -> web.StreamResponse:
        return json_response({"status": "ok"})

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        rollout_id: str | None = None
        match = ROLLOUT_PREFIX.match(path)
        if match is not None:
            rollout_id = match.group("rollout_id")
            path = match.group("rest") or "/"
        methods = self._routes.get(path)
        if methods is None and len(path) > 1 and path.endswith("/"):
            methods = self._routes.get(path.rstrip("/"))
        if methods is None:
            return json_response({"detail": "Not Found"}, status=404)
        handler = methods.get(request.method)
        if handler is None:
            return json_response({"detail": "Method Not Allowed"}, status=405)
        is_health = path in HEALTH_PATHS
        if is_health:
            ctx = RequestContext(request, path, rollout_id, "")
        else:
            given = request.cookies.get(self.cookie_name)
            ctx = RequestContext(
                request,
                path,
                rollout_id,
                given or self._mint_session_id(),
                self._open_session,
                cookie_given=bool(given),
                known_session=self.session_usable,
            )
        try:
            response = await handler(ctx)
        except HttpError as exc:
            response = json_response(exc.payload, status=exc.status, headers=exc.headers)
        except asyncio.CancelledError:
            raise
        except web.HTTPRequestEntityTooLarge:
            response = json_response(
                {"detail": f"request body is over the server's limit of {MAX_BODY_BYTES} bytes"}, status=413
            )
        except web.HTTPException:
            raise
        except Exception as exc:
            logger.warning("%s: %s %s raised %r", self.cookie_name, request.method, request.path, exc)
            logger.debug("traceback", exc_info=True)
            response = json_response(repr(exc), status=500)
        if not is_health and not response.prepared:
            if COOKIE_VALUE.match(ctx.session_id):
                # What set_cookie writes for a plain value, without building a SimpleCookie per reply.
                response.headers.add("Set-Cookie", f"{self.cookie_name}={ctx.session_id}{COOKIE_ATTRIBUTES}")
            else:
                response.set_cookie(self.cookie_name, ctx.session_id, httponly=True, samesite="Lax")
        return response


# ------------------------------------------------------------------ running
@dataclass
class RunningServer:
    """A server started in the current event loop; ``await stop()`` ends it."""

    url: str
    host: str
    port: int
    _runner: web.AppRunner

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def __aenter__(self) -> RunningServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def start_server(
    server: GymServer | web.Application, host: str = "127.0.0.1", port: int = 0
) -> RunningServer:
    """Start ``server`` in this loop on ``host:port`` (``port=0``: a free port) and return its URL.

    Raises :class:`ServeError` (one line: the address and why) when the port is out of range or
    cannot be bound; nothing is left running then.
    """
    check_port(port)
    app = server.make_app() if isinstance(server, GymServer) else server
    runner = web.AppRunner(
        app, access_log=None, handle_signals=False, shutdown_timeout=1.0, handler_cancellation=True
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024, reuse_address=True)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise bind_error(host, port, exc) from exc
    bound_port = int(runner.addresses[0][1])
    return RunningServer(url=f"http://{host}:{bound_port}", host=host, port=bound_port, _runner=runner)


SERVER_GC_GEN0_THRESHOLD = 20_000
"""Young-generation GC threshold of a serving process (CPython's default: 700)."""


def tune_gc_for_serving() -> None:
    """Make the cyclic GC cheap for a long-running server process (called by :func:`serve`).

    With C rollouts in flight, their request objects are alive when a young
    collection runs, so they survive, get promoted and are traversed again by the
    older collections: per-rollout GC work grows with C (profiled at C=256 vs 32:
    about half of the agent's extra CPU per rollout; docs/http.md). ``gc.freeze()``
    moves everything built at start-up (modules, classes, routes) out of the
    collector's sight, and a larger young threshold lets most per-request objects
    die (by reference count) before any collection sees them.
    """
    gc.freeze()
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(gen0, SERVER_GC_GEN0_THRESHOLD), gen1, gen2)


def serve(
    server: GymServer,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    tune_gc: bool = True,
    announce: Callable[[str], None] | None = None,
) -> None:
    """Serve ``server`` until SIGINT / SIGTERM (blocking; for CLIs and ``python -m``).

    The port is bound first; only then is ``announce(url)`` called (a CLI prints its
    ``serving ... on URL`` line there) and the start logged. A port that is out of range or
    cannot be bound raises :class:`ServeError` before anything is announced.

    ``tune_gc`` (default on): this process is a server, so :func:`tune_gc_for_serving`
    applies (``serve`` owns the process; :func:`start_server`, which runs inside a
    caller's loop, never touches the GC).
    """
    check_port(port)
    running: list[RunningServer] = []

    async def start() -> None:
        running.append(await start_server(server, host, port))

    async def stop() -> None:
        for each in running:
            await each.stop()

    def on_bound() -> None:
        url = running[0].url
        logger.info("serving %s on %s", server.cookie_name, url)
        if tune_gc:
            tune_gc_for_serving()
        if announce is not None:
            announce(url)

    asyncio.run(serve_until_stopped(start, stop, on_bound))
