"""GymClient: run dataset rows through NeMo Gym agents over HTTP, with deadlines.

``await client.run(row)`` posts the row to its agent's ``/run`` and returns a
:class:`RolloutOutcome`; ``client.run_many(rows)`` yields one outcome per row
as rollouts complete.

Invariants:

* every row yields **exactly one** outcome (nothing lost, nothing duplicated),
  whatever happens: bad rows, dead servers, bugs in the client itself;
* every attempt has a deadline: the row's whole budget (``deadline_s``) bounds
  all attempts and backoff sleeps together; when it passes, the in-flight
  request is cancelled and the outcome is ``timeout``;
* retries are bounded (``max_attempts``) with exponential backoff + jitter
  (tenacity) and only for infrastructure faults: transport errors, 5xx, 408,
  429, and a masked result reporting an environment fault mid-episode (``mask_sample``
  with a ``transport_*`` ``failure_kind``: ``gymbridge.faults``; ``status`` is then the
  environment's, None when it broke the connection). Other 4xx, malformed results and rows
  or results nested deeper than ``gymbridge.limits.MAX_JSON_DEPTH`` are ``data`` failures,
  never retried, and so is a stock agent's 500 around an inner server's 4xx (a model server
  refusing the row's sampling parameters behind genuine ``simple_agent``: ``status`` is then
  the inner one); an agent's 409 ``X-Gymbridge-Error: env_session_lost`` is an
  ``env_session_lost`` failure, its 503 ``X-Gymbridge-Error: generator_lost`` a ``generator_lost``
  one (not retried: the fleet's router already tried every healthy replica);
* transport exceptions are mapped to gymbridge errors in one place per HTTP library
  (:func:`_map_aiohttp_errors`, :func:`_map_httpx_errors`); nothing else sees them;
* the row sent is the row given: the client never adds keys to
  ``responses_create_params`` (genuine servers answer 422 to unknown keys);
* no cookie is kept between rollouts: an agent's ``Set-Cookie`` never rides along on the
  next row's request.

``POST /run`` goes through one aiohttp session (its connection pool bounded by
``max_connections``, no cookie jar, orjson bodies); with an explicit httpx ``transport``
(``httpx.MockTransport`` / ``httpx.ASGITransport`` in tests) it goes through httpx instead.
Discovery (``GET /global_config_dict_yaml``, once) always uses httpx.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sized
from dataclasses import dataclass
from http.cookiejar import CookieJar
from pathlib import Path
from typing import IO, Any

import aiohttp
import httpx
import orjson
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from gymbridge.client._discovery import env_of_row, parse_global_config, server_urls
from gymbridge.client._outcome import FailureKind, RolloutOutcome
from gymbridge.errors import (
    EnvError,
    EnvFaultError,
    EnvServerError,
    EnvSessionLostError,
    EnvTimeoutError,
    EnvTransportError,
    GeneratorLostError,
    GymbridgeError,
    ProtocolError,
)
from gymbridge.faults import fault_of_result, wrapped_client_error
from gymbridge.limits import MAX_JSON_DEPTH, json_too_deep, loads_json

__all__ = ["GymClient"]

logger = logging.getLogger(__name__)

POOL_SHARD_SIZE = 8
"""Connections per httpx client (the ``transport=`` path): small pools keep httpx's pool scan cheap;
the measurement behind 8 is in docs/http.md, "Measured numbers"."""


class _NoCookies(CookieJar):
    """A cookie jar that keeps nothing (an agent's cookie must not ride along on the next row)."""

    def extract_cookies(self, response: Any, request: Any) -> None:
        return None

    def set_cookie(self, cookie: Any) -> None:
        return None


class _DataError(GymbridgeError):
    """A row that cannot be routed or sent (never retried)."""


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, EnvServerError):
        return exc.retryable
    return isinstance(exc, (EnvTransportError, EnvFaultError))


def _classify(exc: BaseException) -> FailureKind:
    if isinstance(exc, EnvSessionLostError):
        return "env_session_lost"
    if isinstance(exc, GeneratorLostError):
        return "generator_lost"
    if isinstance(exc, EnvTimeoutError):
        return "timeout"
    if isinstance(exc, (EnvTransportError, EnvFaultError)) or (
        isinstance(exc, EnvServerError) and exc.retryable
    ):
        return "infra"
    return "data"


@contextlib.contextmanager
def _map_httpx_errors(url: str, timeout_s: float) -> Iterator[None]:
    """The one place httpx exceptions become gymbridge errors.

    No connection yet (connect or pool timeout: the server is down or saturated)
    is a transport error (infrastructure, retried); a timeout after that is the
    deadline passing (``timeout``); any other transport failure (refused, reset,
    closed mid-body) is a transport error.
    """
    try:
        yield
    except (httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
        raise EnvTransportError(f"{url}: {type(exc).__name__}: could not connect", server=url) from exc
    except httpx.TimeoutException as exc:
        raise EnvTimeoutError(f"{url}: no answer within {timeout_s:.3g}s", server=url) from exc
    except httpx.TransportError as exc:
        raise EnvTransportError(f"{url}: {type(exc).__name__}: {exc}", server=url) from exc


@contextlib.contextmanager
def _map_aiohttp_errors(url: str, timeout_s: float) -> Iterator[None]:
    """The one place aiohttp exceptions become gymbridge errors (the same classes as httpx's).

    A connect timeout (no connection yet) is a transport error; ``TimeoutError`` from the
    attempt's own deadline is the deadline passing; refused, reset, closed mid-body and invalid
    HTTP are transport errors.
    """
    try:
        yield
    except aiohttp.ServerTimeoutError as exc:  # sock_connect (or a socket read) timing out
        raise EnvTransportError(f"{url}: {type(exc).__name__}: could not connect", server=url) from exc
    except TimeoutError as exc:
        raise EnvTimeoutError(f"{url}: no answer within {timeout_s:.3g}s", server=url) from exc
    except aiohttp.ClientError as exc:
        raise EnvTransportError(f"{url}: {type(exc).__name__}: {exc}", server=url) from exc


@dataclass(frozen=True, slots=True)
class _Reply:
    status: int
    headers: Mapping[str, str]
    """Case-insensitive."""
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")


class GymClient:
    """Async client for NeMo Gym agents (``POST /run``): one agent, a head server's, or a map of your own.

    Give exactly one of ``agent_url`` (every row goes there), ``head_url`` (a row goes to the agent
    its ``agent_ref`` names, as the head server lists them) or ``agents`` (``{name: URL}``: the
    same routing over agents you started yourself, no head server). Use as an async context
    manager (or call :meth:`aclose`). ``transport`` lets tests plug in ``httpx.MockTransport`` /
    ``httpx.ASGITransport`` (the module docstring says which HTTP library carries what).
    """

    def __init__(
        self,
        agent_url: str | None = None,
        *,
        head_url: str | None = None,
        agents: Mapping[str, str] | None = None,
        deadline_s: float = 900.0,
        connect_timeout_s: float = 10.0,
        max_attempts: int = 3,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 10.0,
        max_connections: int = 256,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if sum(x is not None for x in (agent_url, head_url, agents)) != 1:
            raise ValueError(
                "give exactly one of agent_url (direct), head_url (discovery) or agents (name -> URL)"
            )
        if agents is not None and not agents:
            raise ValueError("agents: give at least one agent (name -> URL)")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.agent_url = agent_url.rstrip("/") if agent_url else None
        self.head_url = head_url.rstrip("/") if head_url else None
        self.deadline_s = deadline_s
        self.connect_timeout_s = connect_timeout_s
        self.max_attempts = max_attempts
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._use_httpx = transport is not None
        # httpcore's pool scans every queued request against every connection on each request and
        # release (quadratic: with one 32-connection pool at 32 in flight, ~2,900 is_idle() calls per
        # rollout, most of the client's CPU; docs/http.md), so the connections are split over shards
        # of at most POOL_SHARD_SIZE, each its own AsyncClient; a row always uses the same shard.
        # One TLS context serves every shard (building one costs ~17 ms).
        shards = max(1, -(-max_connections // POOL_SHARD_SIZE)) if self._use_httpx else 1
        per_shard = -(-max_connections // shards)
        tls = httpx.create_ssl_context()
        self._pool = [
            httpx.AsyncClient(
                transport=transport,
                verify=tls,
                limits=httpx.Limits(max_connections=per_shard, max_keepalive_connections=per_shard),
                timeout=httpx.Timeout(deadline_s, connect=connect_timeout_s),
                cookies=_NoCookies(),
            )
            for _ in range(shards)
        ]
        self._http = self._pool[0]
        self._agents: dict[str, str] | None = (
            {str(name): url.rstrip("/") for name, url in agents.items()} if agents is not None else None
        )
        """The agents by name: ``agents``, or the head server's once discovered."""
        self._discover_lock = asyncio.Lock()

    async def __aenter__(self) -> GymClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await asyncio.gather(*(client.aclose() for client in self._pool))
        session, self._session = self._session, None
        if session is not None and self._session_loop is asyncio.get_running_loop():
            await session.close()

    def _aiohttp(self) -> aiohttp.ClientSession:
        """The session of the running loop (made on first use; a new loop gets a new one)."""
        loop = asyncio.get_running_loop()
        if self._session is None or self._session_loop is not loop or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0),
                cookie_jar=aiohttp.DummyCookieJar(),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s),
                auto_decompress=True,
            )
            self._session_loop = loop
        return self._session

    # ------------------------------------------------------------ discovery
    async def discover(self) -> dict[str, str]:
        """``{agent instance name: URL}``: the head server's (cached after the first call), or ``agents``."""
        if self.head_url is None:
            return dict(self._agents or {})
        async with self._discover_lock:
            if self._agents is None:
                url = f"{self.head_url}/global_config_dict_yaml"
                timeout_s = self.connect_timeout_s * 3
                with _map_httpx_errors(url, timeout_s):
                    reply = await self._http.get(url, timeout=timeout_s)
                if reply.status_code != 200:
                    raise EnvServerError(
                        f"{url} answered HTTP {reply.status_code}",
                        status=reply.status_code,
                        body=reply.text[:2000],
                        server=url,
                    )
                try:
                    body = orjson.loads(reply.content)
                except orjson.JSONDecodeError:
                    body = reply.text  # tolerate a head server that sends the YAML unquoted
                self._agents = server_urls(parse_global_config(body), self.head_url)
                logger.info(
                    "discovered %d agent(s) at %s: %s", len(self._agents), self.head_url, self._agents
                )
        return dict(self._agents)

    async def agent_url_for(self, row: dict[str, Any]) -> str:
        """The agent URL a row goes to: the direct URL, or the agent its ``agent_ref`` names (the head
        server's or ``agents``; a row without one goes to the only agent there is)."""
        if self.agent_url is not None:
            return self.agent_url
        agents = await self.discover()
        lister = "the head server lists" if self.head_url is not None else "the client has"
        name = env_of_row(row)
        if name is not None:
            if name not in agents:
                raise _DataError(
                    f"agent_ref names {name!r}, not one of the agents {lister} ({sorted(agents)})"
                )
            return agents[name]
        if len(agents) == 1:
            return next(iter(agents.values()))
        raise _DataError(f"row has no agent_ref and {lister} {len(agents)} agents ({sorted(agents)})")

    # ------------------------------------------------------------- one row
    async def _post_run(
        self, url: str, row: dict[str, Any], timeout_s: float, shard: int = 0
    ) -> dict[str, Any]:
        """One attempt: POST the row, check the result's shape."""
        endpoint = f"{url}/run"
        try:
            content = orjson.dumps(row, option=orjson.OPT_SERIALIZE_NUMPY)
        except orjson.JSONEncodeError as exc:  # a TypeError subclass: never let it out of run()
            raise _DataError(f"row cannot be sent as JSON: {exc}") from exc
        reply = await self._post(endpoint, content, timeout_s, shard)
        if not 200 <= reply.status < 300:
            lost = (
                reply.status == 409
                and reply.headers.get(EnvSessionLostError.header) == EnvSessionLostError.failure_class
            )
            if reply.status == 503 and (
                reply.headers.get(GeneratorLostError.header) == GeneratorLostError.failure_class
            ):
                raise GeneratorLostError(
                    f"{endpoint} answered HTTP 503 generator_lost: {reply.text[:300]}",
                    status=503,
                    body=reply.text[:4000],
                    server=endpoint,
                )
            refused = wrapped_client_error(reply.status, reply.text)
            if refused is not None:  # a stock agent's 500 around an inner refusal: data, not retried
                raise EnvServerError(
                    f"{endpoint} answered HTTP 500 around an inner server's HTTP {refused} (the request "
                    f"was refused; retrying cannot help): {reply.text[:300]}",
                    status=refused,
                    body=reply.text[:4000],
                    server=endpoint,
                )
            raise (EnvSessionLostError if lost else EnvServerError)(
                f"{endpoint} answered HTTP {reply.status}: {reply.text[:300]}",
                status=reply.status,
                body=reply.text[:4000],
                server=endpoint,
            )
        try:
            result = loads_json(reply.content, f"{endpoint}: result")
        except ProtocolError as exc:
            raise ProtocolError(f"{exc}: {reply.text[:200]!r}") from exc
        if not isinstance(result, dict):
            raise ProtocolError(f"{endpoint}: result is a {type(result).__name__}, not an object")
        reward = result.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise ProtocolError(f"{endpoint}: result has no numeric 'reward' (got {reward!r})")
        if not isinstance(result.get("response"), dict):
            raise ProtocolError(f"{endpoint}: result has no 'response' object")
        fault = fault_of_result(result, server=endpoint)
        if fault is not None:  # the environment failed mid-episode: the reward measures nothing
            raise fault
        return result

    async def _post(self, endpoint: str, content: bytes, timeout_s: float, shard: int) -> _Reply:
        """One POST of a JSON body within ``timeout_s``; transport faults as gymbridge errors."""
        headers = {"Content-Type": "application/json"}
        if self._use_httpx:
            with _map_httpx_errors(endpoint, timeout_s):
                answer = await self._pool[shard % len(self._pool)].post(
                    endpoint,
                    content=content,
                    headers=headers,
                    timeout=httpx.Timeout(timeout_s, connect=min(self.connect_timeout_s, timeout_s)),
                )
            return _Reply(answer.status_code, answer.headers, answer.content)
        with _map_aiohttp_errors(endpoint, timeout_s):
            async with asyncio.timeout(timeout_s):
                async with self._aiohttp().post(endpoint, data=content, headers=headers) as resp:
                    return _Reply(resp.status, resp.headers, await resp.read())

    async def run(
        self, row: dict[str, Any], *, deadline_s: float | None = None, index: int = 0
    ) -> RolloutOutcome:
        """Run one row to an outcome; never raises for a failed rollout (only on cancellation)."""
        budget = self.deadline_s if deadline_s is None else deadline_s
        started = time.monotonic()
        attempts = 0
        url: str | None = None
        last_status: int | None = None

        def outcome(
            result: dict[str, Any] | None = None, kind: FailureKind | None = None, reason: str | None = None
        ) -> RolloutOutcome:
            return RolloutOutcome(
                index=index,
                row=row,
                result=result,
                kind=kind,
                reason=reason,
                attempts=attempts,
                elapsed_s=time.monotonic() - started,
                agent_url=url,
                status=last_status,
            )

        rcp = row.get("responses_create_params", {}) if isinstance(row, dict) else None
        if not isinstance(rcp, dict):
            # absent is fine (aviary-style agents fill it in); present must be an object
            return outcome(
                kind="data", reason="row is not an object, or its 'responses_create_params' is not one"
            )
        if json_too_deep(row):
            return outcome(
                kind="data", reason=f"row nests arrays/objects deeper than {MAX_JSON_DEPTH} levels"
            )
        last_error: BaseException | None = None
        try:
            async with asyncio.timeout(budget):
                url = await self.agent_url_for(row)
                retrying = AsyncRetrying(
                    stop=stop_after_attempt(self.max_attempts),
                    wait=wait_exponential_jitter(
                        multiplier=self.backoff_initial_s,
                        max=self.backoff_max_s,
                        jitter=self.backoff_initial_s,
                    ),
                    retry=retry_if_exception(_retryable),
                    reraise=True,
                )
                async for attempt in retrying:
                    with attempt:
                        attempts += 1
                        remaining = budget - (time.monotonic() - started)
                        try:
                            result = await self._post_run(url, row, max(remaining, 1e-3), shard=index)
                        except (EnvServerError, EnvFaultError) as exc:
                            last_status, last_error = exc.status, exc
                            logger.debug("row %d attempt %d: %s", index, attempts, exc)
                            raise
                        except GymbridgeError as exc:
                            last_error = exc
                            raise
                        last_status = 200
                return outcome(result=result)
        except TimeoutError:
            detail = f" (last error: {last_error})" if last_error is not None else ""
            return outcome(
                kind="timeout", reason=f"deadline of {budget:g}s passed after {attempts} attempt(s){detail}"
            )
        except (EnvError, ProtocolError, _DataError) as exc:
            return outcome(kind=_classify(exc), reason=str(exc))

    # ------------------------------------------------------------ many rows
    async def run_many(
        self,
        rows: Iterable[dict[str, Any]],
        *,
        concurrency: int = 32,
        deadline_s: float | None = None,
        progress: bool = True,
        failures_path: str | Path | None = None,
    ) -> AsyncIterator[RolloutOutcome]:
        """Yield one outcome per row, in completion order, with at most ``concurrency`` in flight.

        ``progress`` shows a tqdm bar (done, failed, rollouts/s, mean reward);
        ``failures_path`` appends each failed outcome as one jsonl record.
        Breaking out of the loop cancels the rollouts still in flight.
        """
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        from tqdm.auto import tqdm

        total = len(rows) if isinstance(rows, Sized) else None
        source = iter(enumerate(rows))
        queue: asyncio.Queue[RolloutOutcome | None] = asyncio.Queue()
        source_error: list[BaseException] = []

        async def worker() -> None:
            try:
                while True:
                    try:
                        index, row = next(source)
                    except StopIteration:
                        return
                    try:
                        result = await self.run(row, deadline_s=deadline_s, index=index)
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:  # a client bug must not lose the row
                        logger.exception("internal error running row %d", index)
                        result = RolloutOutcome(
                            index=index, row=row, kind="infra", reason=f"internal client error: {exc!r}"
                        )
                    queue.put_nowait(result)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the rows iterable itself failed
                source_error.append(exc)
            finally:
                queue.put_nowait(None)

        workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
        bar = tqdm(total=total, disable=not progress, unit="rollout", dynamic_ncols=True)
        failures_file: IO[bytes] | None = None
        done = failed = 0
        reward_sum = 0.0
        started = time.monotonic()
        try:
            finished = 0
            while finished < len(workers):
                item = await queue.get()
                if item is None:
                    finished += 1
                    continue
                done += 1
                if item.ok:
                    reward_sum += item.reward or 0.0
                else:
                    failed += 1
                    if failures_path is not None:
                        if failures_file is None:
                            Path(failures_path).parent.mkdir(parents=True, exist_ok=True)
                            failures_file = open(failures_path, "ab")  # noqa: SIM115, ASYNC230 - closed in finally; tiny appends
                        failures_file.write(orjson.dumps(item.failure_record()) + b"\n")
                        failures_file.flush()
                succeeded = done - failed
                bar.update(1)
                bar.set_postfix(
                    failed=failed,
                    rps=f"{done / max(time.monotonic() - started, 1e-9):.1f}",
                    reward=f"{reward_sum / succeeded:.3f}" if succeeded else "n/a",
                    refresh=False,
                )
                yield item
            if source_error:
                raise source_error[0]
        finally:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            bar.close()
            if failures_file is not None:
                failures_file.close()
