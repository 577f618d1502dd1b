"""SimpleAgent: drives one rollout per ``POST /run`` (NeMo Gym's simple / gymnasium agent).

Tool style: ``seed_session`` -> model -> tool calls -> model -> ... -> ``verify``. Gymnasium style
(``gymnasium=True``): ``reset`` -> model -> ``step`` -> ... until ``terminated``, ``truncated`` or
``max_steps``. The result is the stock verify shape (row echo + ``response`` holding every item of
every turn + ``reward``); ``POST /v1/responses`` runs the model -> tools loop alone, as stock
simple_agent serves it. :meth:`SimpleAgent.counters` (``GET /counters``) times every outbound call.

Invariants:

* ``max_steps`` is bounded and every outbound call has a deadline; a transport failure or deadline
  towards the model or the environment's ``seed_session`` / ``reset`` / ``verify`` answers 502 /
  504 (the client retries);
* an environment fault in the middle of an episode ends the rollout with a *masked result*
  (HTTP 200, ``reward: 0.0``, ``mask_sample: true``, ``failure_kind``, ``env_fault``), never a
  trained one; an environment that lost the session answers 409 ``env_session_lost``;
* ``responses_create_params`` reaches the model exactly as the row gave it except ``input``, and
  model output items are replayed unchanged, token fields included;
* the model may call only the tools the row offers, never a protocol route; tool errors go back
  to the model as text, as stock Gym does;
* a model-server error is an agent 500, except an inner 4xx, which keeps its status (data, not
  retried), and a fleet router's 503 ``X-Gymbridge-Error: generator_lost``, which keeps both;
* with ``media_store_url`` every inline medium joins the conversation as a reference, stored once
  (the store failing ends the rollout with 502); ``meter`` records every model call's payload.

The behaviour in detail (cookies, rollout prefixes, tool media, faults): docs/http.md, "The simple
agent"; counters: docs/timing.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from gymbridge.errors import (
    EnvError,
    EnvFaultError,
    EnvServerError,
    EnvTimeoutError,
    GeneratorLostError,
    ProtocolError,
)
from gymbridge.faults import env_fault, masked_result, status_fault_kind, wrapped_client_error
from gymbridge.metrics.timing import PhaseTimer
from gymbridge.server._base import (
    ERROR_HEADER,
    ROLLOUT_ID,
    SESSION_LOST,
    GymServer,
    HttpError,
    RequestContext,
    json_response,
)
from gymbridge.server._episode import (
    GymnasiumEpisode,
    ToolEpisode,
    input_items,
    offered_tool_names,
    tool_call_request,
    tool_output_items,
)
from gymbridge.server._http import Reply, make_client_session, post_json
from gymbridge.server._media import MediaReferencer
from gymbridge.server._tools import PARTS_HEADER

if TYPE_CHECKING:
    from gymbridge.metrics import PayloadMeter

__all__ = ["SimpleAgent", "rollout_id_from_row"]

logger = logging.getLogger(__name__)

TOKEN_CAPTURE_SEGMENT = "/training-token-capture"
GENERATOR_LOST = GeneratorLostError.failure_class
"""``X-Gymbridge-Error`` value of a model call the generator fleet lost (kept on the agent's 503)."""


def rollout_id_from_row(row: dict[str, Any]) -> str | None:
    """Stock Gym's rollout id of a ``/run`` row, or None when the row has no identity.

    ``_ng_rollout_id`` when given (it must match :data:`ROLLOUT_ID`, else
    ``ValueError``), else ``<_ng_task_index>-<_ng_rollout_index>``; ``-a<n>`` is
    appended for ``_ng_attempt_index`` n > 0.
    """
    explicit = row.get("_ng_rollout_id")
    if explicit is not None:
        if not (isinstance(explicit, str) and ROLLOUT_ID.match(explicit)):
            raise ValueError(
                "_ng_rollout_id must be letters, digits, dots, dashes or underscores starting with a "
                f"letter or digit; got {explicit!r}"
            )
        rollout_id = explicit
    else:
        task, rollout = row.get("_ng_task_index"), row.get("_ng_rollout_index")
        if task is None or rollout is None:
            return None
        rollout_id = f"{task}-{rollout}"
        if not ROLLOUT_ID.match(rollout_id):
            raise ValueError(f"_ng_task_index / _ng_rollout_index give an unusable rollout id {rollout_id!r}")
    attempt = row.get("_ng_attempt_index")
    if attempt is not None:
        try:
            n = int(attempt)
        except (TypeError, ValueError):
            raise ValueError(f"_ng_attempt_index must be an integer, got {attempt!r}") from None
        if n > 0:
            rollout_id = f"{rollout_id}-a{n}"
    return rollout_id


@dataclass(frozen=True)
class _Route:
    """Where one rollout's outbound calls go: the rollout prefix (or none) for each server."""

    rollout_id: str | None = None
    token_capture: bool = False

    @property
    def prefix(self) -> str:
        return f"/ng-rollout/{self.rollout_id}" if self.rollout_id else ""

    def model(self, path: str) -> str:
        capture = TOKEN_CAPTURE_SEGMENT if self.rollout_id and self.token_capture else ""
        return f"{self.prefix}{capture}{path}"

    def resources(self, path: str) -> str:
        return f"{self.prefix}{path}"


class _UpstreamFailure(Exception):
    """The rollout cannot continue: answer ``status`` with a JSON-string body (and ``headers``)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


class _EpisodeFault(_UpstreamFailure):
    """The environment failed mid-episode (``fault``); ``response`` is the conversation so far.

    ``/run`` answers it with a masked result (:func:`~gymbridge.faults.masked_result`); a route
    with no result to mask (``/v1/responses``) answers 502, as for any upstream failure.
    """

    def __init__(self, fault: EnvFaultError, response: dict[str, Any]) -> None:
        super().__init__(502, str(fault))
        self.fault = fault
        self.response = response


def _session_lost(reply: Reply) -> bool:
    return reply.status == 409 and reply.headers.get(ERROR_HEADER) == SESSION_LOST


class SimpleAgent(GymServer):
    """The agent server: ``POST /run`` takes a dataset row and returns the verify result."""

    def __init__(
        self,
        *,
        resources_url: str,
        model_url: str,
        max_steps: int = 8,
        gymnasium: bool = False,
        model_timeout_s: float = 600.0,
        tool_timeout_s: float = 120.0,
        env_timeout_s: float = 120.0,
        tool_media: str = "user_message",
        max_connections: int = 1024,
        instance_name: str = "simple_agent",
        rollout_prefix: bool = False,
        media_store_url: str | None = None,
        meter: PayloadMeter | None = None,
    ) -> None:
        super().__init__(instance_name=instance_name)
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        if tool_media not in ("user_message", "output"):
            raise ValueError(f"tool_media must be 'user_message' or 'output', got {tool_media!r}")
        self.resources_url = resources_url.rstrip("/")
        self.model_url = model_url.rstrip("/")
        self.max_steps = max_steps
        self.gymnasium = gymnasium
        self.model_timeout_s = model_timeout_s
        self.tool_timeout_s = tool_timeout_s
        self.env_timeout_s = env_timeout_s
        self.tool_media = tool_media
        self.max_connections = max_connections
        self.rollout_prefix = rollout_prefix
        self.media = MediaReferencer(media_store_url) if media_store_url else None
        self.meter = meter
        self._model_keys: set[str] = set()
        """Media-reference keys already counted as physical at ``model_request``."""
        self._client: aiohttp.ClientSession | None = None
        self.timings = PhaseTimer()
        """Seconds per phase as this agent sees them (module docstring, "Counters")."""
        self.add_route("POST", "/run", self._run_endpoint)
        self.add_route("GET", "/counters", self._counters_endpoint)
        self.add_route("POST", "/v1/responses", self._responses_endpoint)
        self.add_route("POST", f"{TOKEN_CAPTURE_SEGMENT}/v1/responses", self._responses_endpoint)
        self.add_route("POST", "/aggregate_metrics", self._aggregate_endpoint)

    async def on_startup(self) -> None:
        self._client = make_client_session(self.max_connections)

    async def on_cleanup(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    @property
    def client(self) -> aiohttp.ClientSession:
        if self._client is None:
            raise RuntimeError("SimpleAgent is not serving (its client session opens at startup)")
        return self._client

    # ------------------------------------------------------------ endpoints
    async def _run_endpoint(self, ctx: RequestContext) -> web.StreamResponse:
        row = await ctx.json_object()
        rcp = row.get("responses_create_params")
        if not isinstance(rcp, dict):
            raise HttpError(
                422,
                {
                    "detail": [
                        {
                            "type": "missing",
                            "loc": ["body", "responses_create_params"],
                            "msg": "Field required",
                        }
                    ]
                },
            )
        caller_cookies = {k: v for k, v in ctx.request.cookies.items() if k != self.cookie_name}
        try:
            route = self._route(ctx, row)
            with self.timings.time("run"):
                if self.gymnasium:
                    result = await self._run_gymnasium(row, caller_cookies, route)
                else:
                    result = await self._run_tools(row, caller_cookies, route)
        except _UpstreamFailure as exc:
            logger.warning("%s: rollout failed: %s", self.cookie_name, exc.message)
            return json_response(exc.message, status=exc.status, headers=exc.headers)
        return json_response(result)

    def counters(self) -> dict[str, float]:
        """The agent's counters now (module docstring, "Counters"): every value only grows."""
        return self.timings.snapshot()

    async def _counters_endpoint(self, _ctx: RequestContext) -> web.StreamResponse:
        return json_response(self.counters())

    async def _responses_endpoint(self, ctx: RequestContext) -> web.StreamResponse:
        """Stock ``/v1/responses``: the model -> tools loop on a create-params body (no seed, no verify).

        Gymnasium mode answers as stock ``gymnasium_agent`` does: one model call,
        the caller's cookies forwarded to the model server.
        """
        rcp = await ctx.json_object()
        caller_cookies = {k: v for k, v in ctx.request.cookies.items() if k != self.cookie_name}
        resources_cookies = {} if self.gymnasium else caller_cookies
        route = _Route(ctx.rollout_id, token_capture=ctx.path.startswith(TOKEN_CAPTURE_SEGMENT))
        try:
            if self.gymnasium:
                model_cookies = dict(caller_cookies)
                items = await self._referenced(_as_items(rcp.get("input")))
                response = await self._model(rcp, items, model_cookies, route)
            else:
                response, model_cookies = await self._episode(rcp, resources_cookies, route)
        except _UpstreamFailure as exc:
            logger.warning("%s: /v1/responses failed: %s", self.cookie_name, exc.message)
            return json_response(exc.message, status=exc.status, headers=exc.headers)
        reply = json_response(response)
        for name, value in {**resources_cookies, **model_cookies}.items():
            if name != self.cookie_name:
                reply.set_cookie(name, value)
        return reply

    def _route(self, ctx: RequestContext, row: dict[str, Any]) -> _Route:
        """The rollout prefix for this ``/run``: the inbound one, else (opt-in) the row's identity."""
        if ctx.rollout_id is not None:
            return _Route(ctx.rollout_id, token_capture=ctx.path.startswith(TOKEN_CAPTURE_SEGMENT))
        if not self.rollout_prefix:
            return _Route()
        try:
            return _Route(rollout_id_from_row(row))
        except ValueError as exc:
            raise _UpstreamFailure(422, str(exc)) from None

    async def _aggregate_endpoint(self, ctx: RequestContext) -> web.StreamResponse:
        body = await ctx.json_object()
        try:
            reply = await self._call(f"{self.resources_url}/aggregate_metrics", body, self.env_timeout_s, {})
        except _UpstreamFailure as exc:
            return json_response(exc.message, status=exc.status, headers=exc.headers)
        return web.Response(body=reply.body, status=reply.status, content_type="application/json")

    # --------------------------------------------------------------- calls
    async def _call(
        self, url: str, payload: Any, timeout_s: float, cookies: dict[str, str], phase: str = "env_other"
    ) -> Reply:
        """One outbound call timed as ``phase``; transport faults and deadlines end the rollout (502/504)."""
        try:
            with self.timings.time(phase):
                return await post_json(self.client, url, payload, timeout_s=timeout_s, cookies=cookies)
        except EnvTimeoutError as exc:
            raise _UpstreamFailure(
                504, f"Hit a timeout in {self.cookie_name} calling an inner server: {exc}"
            ) from exc
        except EnvError as exc:
            raise _UpstreamFailure(
                502, f"Hit a transport error in {self.cookie_name} calling an inner server: {exc}"
            ) from exc

    def _require_ok(self, reply: Reply) -> Any:
        """The JSON of a 2xx reply; otherwise the rollout ends.

        A 4xx from an inner server (a row the environment refuses, a request the
        model server rejects) keeps its status, so the client records a data
        failure instead of retrying, and so does a 4xx a stock server wrapped in its
        500 (genuine ``vllm_model`` in front of vLLM: ``gymbridge.faults.wrapped_client_error``);
        everything else answers 500, as stock Gym does.
        """
        if _session_lost(reply):
            raise _UpstreamFailure(
                409,
                f"{SESSION_LOST}: {reply.url} no longer knows this rollout's session: {reply.text[:2000]}",
                {ERROR_HEADER: SESSION_LOST},
            )
        if reply.status == 503 and reply.headers.get(ERROR_HEADER) == GENERATOR_LOST:
            raise _UpstreamFailure(  # the fleet's router lost the call: the class travels to the client
                503, f"{GENERATOR_LOST}: {reply.url}: {reply.text[:2000]}", {ERROR_HEADER: GENERATOR_LOST}
            )
        try:
            reply.raise_for_status()
            return reply.json()
        except (EnvServerError, ProtocolError) as exc:
            status = reply.status if 400 <= reply.status < 500 and reply.status not in (408, 429) else 500
            if status == 500:  # a stock server's 500 around an inner refusal (genuine vllm_model -> vLLM 400)
                status = wrapped_client_error(reply.status, reply.text) or 500
            raise _UpstreamFailure(
                status, f"Hit an exception in {self.cookie_name} calling an inner server: {reply.text[:4000]}"
            ) from exc

    async def _referenced(self, items: list[Any]) -> list[Any]:
        """``items`` with inline media stored and referenced (``media_store_url``), else as given."""
        if self.media is None:
            return items
        try:
            return await self.media.items(self.client, items)
        except EnvError as exc:
            raise _UpstreamFailure(502, f"Hit an error in {self.cookie_name} storing media: {exc}") from exc

    def _meter_model_request(self, body: dict[str, Any]) -> None:
        """Record ``body`` at ``model_request``: a reference's bytes are physical once per key
        (the model server fetches each key once), logical on every copy."""
        from gymbridge.metrics import payload_stats

        assert self.meter is not None
        sizes = self.meter.media_size or (self.media.size_of if self.media is not None else None)
        stats = payload_stats(body, media_size=sizes, sent_keys=self._model_keys)
        self.meter.record_stats("model_request", stats)

    async def _model(
        self, rcp: dict[str, Any], items: list[Any], cookies: dict[str, str], route: _Route
    ) -> dict[str, Any]:
        body = {**rcp, "input": items}
        if self.meter is not None and self.meter.enabled:
            self._meter_model_request(body)
        url = f"{self.model_url}{route.model('/v1/responses')}"
        reply = await self._call(url, body, self.model_timeout_s, cookies, "model")
        cookies.update(reply.cookies)
        response = self._require_ok(reply)
        if not isinstance(response, dict) or not isinstance(response.get("output"), list):
            raise _UpstreamFailure(
                500, f"Received an invalid response from model server: {reply.text[:2000]}"
            )
        return response

    # ---------------------------------------------------------- tool style
    async def _run_tools(self, row: dict[str, Any], caller: dict[str, str], route: _Route) -> dict[str, Any]:
        rcp = row["responses_create_params"]
        resources_cookies = dict(caller)
        seed = await self._call(
            f"{self.resources_url}{route.resources('/seed_session')}",
            row,
            self.env_timeout_s,
            resources_cookies,
            "env_seed",
        )
        self._require_ok(seed)
        resources_cookies.update(seed.cookies)
        try:
            response, model_cookies = await self._episode(rcp, resources_cookies, route)
        except _EpisodeFault as stop:  # no /verify: a reward after an environment fault measures nothing
            return masked_result({**row, "response": stop.response}, stop.fault)
        verify_body = {**row, "response": response}
        reply = await self._call(
            f"{self.resources_url}{route.resources('/verify')}",
            verify_body,
            self.env_timeout_s,
            {**caller, **resources_cookies, **model_cookies},
            "env_verify",
        )
        result = self._require_ok(reply)
        if not isinstance(result, dict) or not isinstance(result.get("reward"), (int, float)):
            raise _UpstreamFailure(500, f"Received an invalid verify response: {reply.text[:2000]}")
        return result

    async def _episode(
        self, rcp: dict[str, Any], resources_cookies: dict[str, str], route: _Route
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """Model -> tools -> model ... (at most ``max_steps`` model calls).

        Returns the rollout's Responses object (every item of every turn in
        ``output``) and the model server's cookies; ``resources_cookies`` is
        updated in place with what the tools set.
        """
        try:
            episode = ToolEpisode(rcp)
        except ProtocolError as exc:
            raise _UpstreamFailure(422, str(exc)) from None
        episode.base_input[:] = await self._referenced(episode.base_input)
        model_cookies: dict[str, str] = {}
        offered = offered_tool_names(rcp)
        for step in range(1, self.max_steps + 1):
            calls = episode.add_response(await self._model(rcp, episode.model_input(), model_cookies, route))
            if calls is None:
                break
            for call in calls:
                try:
                    items = await self._tool(call, offered, resources_cookies, route)
                except EnvFaultError as fault:
                    logger.warning("%s: %s", self.cookie_name, fault)
                    raise _EpisodeFault(fault, episode.response()) from fault
                episode.outputs.extend(await self._referenced(items))
            if step >= self.max_steps:
                episode.stop_at_max_steps()
                logger.info("%s: max_steps=%d reached", self.cookie_name, self.max_steps)
        return episode.response(), model_cookies

    async def _tool(
        self, call: dict[str, Any], offered: frozenset[str], cookies: dict[str, str], route: _Route
    ) -> list[dict[str, Any]]:
        request = tool_call_request(call, offered)
        if isinstance(request, list):
            return request
        name, arguments = request
        path = "/" + name
        url = f"{self.resources_url}{route.resources(path)}"
        try:
            with self.timings.time("env_tool"):
                reply = await post_json(
                    self.client, url, arguments, timeout_s=self.tool_timeout_s, cookies=cookies
                )
        except EnvError as exc:
            raise env_fault(path, tool=name, error=exc, server=self.resources_url) from exc
        if _session_lost(reply):
            raise _UpstreamFailure(
                409,
                f"{SESSION_LOST}: tool {name!r}: the environment no longer knows this rollout's session "
                f"(restarted or evicted): {reply.text[:2000]}",
                {ERROR_HEADER: SESSION_LOST},
            )
        cookies.update(reply.cookies)
        if status_fault_kind(reply.status) is not None:
            raise env_fault(path, tool=name, status=reply.status, body=reply.text, server=self.resources_url)
        return tool_output_items(
            call.get("call_id"), reply.body, reply.headers.get(PARTS_HEADER), self.tool_media
        )

    # ----------------------------------------------------------- gymnasium
    async def _run_gymnasium(
        self, row: dict[str, Any], caller: dict[str, str], route: _Route
    ) -> dict[str, Any]:
        try:
            episode = GymnasiumEpisode(row)
        except ProtocolError as exc:
            raise _UpstreamFailure(422, str(exc)) from None
        env_cookies = dict(caller)
        reset = await self._call(
            f"{self.resources_url}{route.resources('/reset')}",
            row,
            self.env_timeout_s,
            env_cookies,
            "env_seed",
        )
        reset_data = self._require_ok(reset)
        env_cookies.update(reset.cookies)
        try:
            episode.start(reset_data)
        except ProtocolError as exc:
            raise _UpstreamFailure(500, f"Received an invalid reset response: {exc}") from None
        episode.base_input[:] = await self._referenced(episode.base_input)  # also rcp["input"]
        model_cookies: dict[str, str] = {}
        try:
            for _ in range(self.max_steps):
                last = await self._model(episode.rcp, episode.model_input(), model_cookies, route)
                step_body = episode.add_response(last)
                if episode.context_exhausted:
                    break
                try:
                    with self.timings.time("env_step"):
                        reply = await post_json(
                            self.client,
                            f"{self.resources_url}{route.resources('/step')}",
                            step_body,
                            timeout_s=self.env_timeout_s,
                            cookies=env_cookies,
                        )
                except EnvError as exc:
                    raise env_fault("/step", error=exc, server=self.resources_url) from exc
                if status_fault_kind(reply.status) is not None:
                    raise env_fault("/step", status=reply.status, body=reply.text, server=self.resources_url)
                step_data = self._require_ok(reply)
                env_cookies.update(reply.cookies)
                joined = len(episode.outputs)
                try:
                    if episode.add_step(step_data).done:
                        break
                except ProtocolError as exc:
                    raise _UpstreamFailure(
                        500, f"Received an invalid step response ({exc}): {reply.text[:2000]}"
                    ) from None
                episode.outputs[joined:] = await self._referenced(episode.outputs[joined:])
        except EnvFaultError as fault:  # no reward after an environment fault: a masked result
            logger.warning("%s: %s", self.cookie_name, fault)
            return masked_result(episode.result(), fault)
        finally:
            if episode.supports_close:
                try:
                    with self.timings.time("env_other"):
                        await post_json(
                            self.client,
                            f"{self.resources_url}{route.resources('/close')}",
                            {},
                            timeout_s=self.env_timeout_s,
                            cookies=env_cookies,
                        )
                except EnvError:
                    logger.exception("%s: closing the environment failed", self.cookie_name)
        return episode.result()


# ------------------------------------------------------------------ helpers
def _as_items(value: Any) -> list[Any]:
    try:
        return input_items(value)
    except ProtocolError as exc:
        raise _UpstreamFailure(422, str(exc)) from None
