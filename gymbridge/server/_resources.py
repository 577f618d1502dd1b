"""ResourcesServer: the base class an environment author subclasses.

An author declares tools with :func:`~gymbridge.server.tool`, and overrides
``seed_session`` / ``verify`` (tool style) or ``reset`` / ``step`` (gymnasium
style). The base class serves NeMo Gym's resources-server protocol:

========================  ==================================================
``POST /seed_session``    body: the dataset row; answers ``{}`` or a state dict
``POST /<tool>``          body: the tool's JSON arguments; the body text goes
                          back to the model verbatim (errors included)
``POST /verify``          body: row + ``response``; answers the row echoed plus
                          ``reward``, ``reward_components``?, ``mask_sample``,
                          ``failure_kind``, ``failure_reason`` and extras
``POST /reset``           gymnasium: ``{observation, observation_content?, info}``
``POST /step``            gymnasium: row + ``response`` ->
                          ``{observation, observation_content?, reward, terminated, truncated, info}``
``POST /close``           gymnasium: release the session
``POST /close_session``   release the session (0.7.0)
``POST /aggregate_metrics`` ``{verify_responses}`` -> ``{group_level_metrics, agent_metrics, key_metrics}``
``GET /tools``            gymbridge extension: the published function tools
========================  ==================================================

Status codes match stock Gym (FastAPI): bad tool arguments 422 with
``{"detail": [...]}``, an unknown tool 404 ``{"detail": "Not Found"}``, a tool
that raises 500 with the JSON string ``repr(exc)``; malformed JSON 400.
A tool that answers an environment fault (``gymbridge.faults``: 502, 503, 504, 408, 429,
raised as ``HttpError``) has it remembered on the session, and ``verify`` masks the result
(``mask_sample``, ``failure_kind``, ``failure_reason``, ``env_fault``) unless ``verify`` set a
mask of its own: a stock agent shows the fault to the model and scores on. One more
deliberate difference: a tool call, ``verify`` or ``step`` whose session cookie
the server does not know (a restart, an evicted session) answers 409
``env_session_lost`` instead of running against a fresh empty session; only
``seed_session`` / ``reset`` start sessions. Tool names in ``RESERVED_PATHS``
(every protocol route) are refused at class creation.

Invariants: ``reward`` is a finite float; when ``reward_components`` is given
it sums to ``reward`` (checked: a violation is a server bug, answered 500);
a terminated or truncated ``step`` closes the session, as stock Gym's
``GymnasiumServer`` does.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import orjson
from aiohttp import web

from gymbridge.faults import env_fault, fault_record, status_fault_kind
from gymbridge.server._base import (
    RESERVED_TOOL_NAMES,
    GymServer,
    HttpError,
    RequestContext,
    Session,
    json_response,
)
from gymbridge.server._tools import PARTS_HEADER, TOOL_ATTR, ToolOutput, ToolSpec, build_spec, media_part

__all__ = ["Observation", "ResourcesServer", "StepResult", "VerifyResult"]

RESERVED_PATHS = RESERVED_TOOL_NAMES
"""Tool names the SDK refuses (protocol routes; see ``gymbridge.server._base.RESERVED_TOOL_NAMES``)."""


@dataclass
class VerifyResult:
    """What ``verify`` returns: the reward and anything to add to the verify response."""

    reward: float
    reward_components: dict[str, float] | None = None
    mask_sample: bool = False
    failure_kind: str | None = None
    failure_reason: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Observation:
    """A gymnasium observation: a text rendering (stock agents) plus optional content parts."""

    text: str | None = None
    content: list[Any] | None = None
    """Content parts (text, image, audio, video) or ``MediaItem``-like objects (preferred by gymbridge)."""
    info: dict[str, Any] = field(default_factory=dict)

    def payload(self) -> dict[str, Any]:
        out: dict[str, Any] = {"observation": self.text, "info": self.info}
        if self.content is not None:
            out["observation_content"] = [media_part(p) for p in self.content]
        return out


@dataclass
class StepResult:
    """What ``step`` returns."""

    observation: Observation | None = None
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class ResourcesServer(GymServer):
    """Base class of an environment (NeMo Gym resources server) on aiohttp.

    Subclass it, declare tools with ``@tool``, override ``seed_session`` and
    ``verify`` (or ``reset`` and ``step``). ``tool_specs()`` lists the tools;
    ``function_tools()`` gives what to put in ``responses_create_params.tools``.
    """

    _tool_specs: ClassVar[dict[str, ToolSpec]] = {}
    _function_tools_json: ClassVar[bytes | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        specs: dict[str, ToolSpec] = {}
        for klass in reversed(cls.__mro__):
            for attr, value in vars(klass).items():
                marker = getattr(value, TOOL_ATTR, None)
                if marker is None:
                    continue
                spec = build_spec(value, name=marker["name"] or attr, description=marker["description"])
                if spec.name in RESERVED_PATHS:
                    raise TypeError(
                        f"{cls.__name__}: tool name {spec.name!r} collides with a protocol endpoint"
                    )
                specs[spec.name] = spec
        cls._tool_specs = specs

    def __init__(self, *, instance_name: str | None = None, max_sessions: int = 100_000) -> None:
        super().__init__(instance_name=instance_name, max_sessions=max_sessions)
        self.add_route("POST", "/seed_session", self._seed_endpoint)
        self.add_route("POST", "/verify", self._verify_endpoint)
        self.add_route("POST", "/close_session", self._close_endpoint)
        self.add_route("POST", "/aggregate_metrics", self._aggregate_endpoint)
        self.add_route("GET", "/tools", self._tools_endpoint)
        if self.is_gymnasium:
            self.add_route("POST", "/reset", self._reset_endpoint)
            self.add_route("POST", "/step", self._step_endpoint)
            self.add_route("POST", "/close", self._close_endpoint)
        for spec in self._tool_specs.values():
            self.add_route("POST", f"/{spec.name}", self._tool_endpoint(spec))

    # ------------------------------------------------------ author surface
    @classmethod
    def tool_specs(cls) -> dict[str, ToolSpec]:
        return dict(cls._tool_specs)

    @classmethod
    def function_tools(cls) -> list[dict[str, Any]]:
        """Responses-API function tools, ready for ``responses_create_params.tools`` (a fresh copy)."""
        cached = cls.__dict__.get("_function_tools_json")
        if cached is None:
            cached = orjson.dumps([spec.function_tool() for spec in cls._tool_specs.values()])
            cls._function_tools_json = cached
        tools: list[dict[str, Any]] = orjson.loads(cached)
        return tools

    @property
    def is_gymnasium(self) -> bool:
        """True when the subclass implements ``step`` (gymnasium style)."""
        return type(self).step is not ResourcesServer.step

    async def seed_session(self, session: Session, row: dict[str, Any]) -> dict[str, Any] | None:
        """Prepare per-rollout state from the dataset row (default: none)."""
        return None

    async def verify(
        self, session: Session, row: dict[str, Any], response: dict[str, Any]
    ) -> VerifyResult | float | dict[str, Any]:
        """Score one rollout: ``response`` is the whole Responses object of the rollout."""
        raise HttpError(501, {"detail": f"{type(self).__name__} does not implement verify"})

    async def reset(self, session: Session, row: dict[str, Any]) -> Observation:
        """Gymnasium style: start an episode for ``row``."""
        return Observation()

    async def step(self, session: Session, row: dict[str, Any], response: dict[str, Any]) -> StepResult:
        """Gymnasium style: apply this turn's model ``response``."""
        raise NotImplementedError

    async def close(self, session: Session) -> None:
        """Release what the session holds (called on close and at episode end)."""

    def compute_metrics(self, verify_responses: list[dict[str, Any]]) -> dict[str, Any]:
        """Hook: extra agent-level metrics from all verify responses."""
        return {}

    # ------------------------------------------------------------- routes
    async def _seed_endpoint(self, ctx: RequestContext) -> web.StreamResponse:
        row = await ctx.json_object()
        result = await self.seed_session(ctx.session, row)
        return json_response(result or {})

    async def _verify_endpoint(self, ctx: RequestContext) -> web.StreamResponse:
        body = await ctx.json_object()
        _require_keys(body, ("responses_create_params", "response"))
        response = body["response"]
        if not isinstance(response, dict) or not isinstance(response.get("output"), list):
            raise HttpError(
                422,
                {
                    "detail": [
                        {"type": "missing", "loc": ["body", "response", "output"], "msg": "Field required"}
                    ]
                },
            )
        session = ctx.existing_session()
        result = _as_verify_result(await self.verify(session, body, response))
        if session.faults and not result.mask_sample:
            # an agent that went on after a tool's fault (stock agents show it to the model): the
            # reward is not a measurement, and the result says so in 0.7.0's terms (gymbridge.faults)
            fault = session.faults[0]
            result = replace(
                result,
                mask_sample=True,
                failure_kind=fault.failure_kind,
                failure_reason=str(fault),
                extra={**result.extra, "env_fault": fault_record(fault)},
            )
        payload = _verify_payload(type(self).__name__, body, result)
        self.finish_session(session.id)  # verify is the rollout's last call
        return json_response(payload)

    async def _reset_endpoint(self, ctx: RequestContext) -> web.StreamResponse:
        row = await ctx.json_object()
        _require_keys(row, ("responses_create_params",))
        observation = await self.reset(ctx.session, row)
        return json_response(observation.payload())

    async def _step_endpoint(self, ctx: RequestContext) -> web.StreamResponse:
        body = await ctx.json_object()
        _require_keys(body, ("responses_create_params", "response"))
        result = await self.step(ctx.existing_session(), body, body["response"])
        if not math.isfinite(float(result.reward)):
            raise ValueError(f"step reward must be finite, got {result.reward!r}")
        payload = (result.observation or Observation()).payload()
        payload.update(
            reward=float(result.reward),
            terminated=bool(result.terminated),
            truncated=bool(result.truncated),
            info={**payload["info"], **result.info},
        )
        if result.terminated or result.truncated:
            await self.close(ctx.session)
            self.drop_session(ctx.session.id)
        return json_response(payload)

    async def _close_endpoint(self, ctx: RequestContext) -> web.StreamResponse:
        body = await ctx.json() if (await ctx.body_bytes()).strip() else {}
        await self.close(ctx.session)
        self.drop_session(ctx.session.id)
        if isinstance(body, dict) and "resources_session_id" in body:
            return json_response({"resources_session_id": body["resources_session_id"]})
        return json_response({})

    async def _tools_endpoint(self, ctx: RequestContext) -> web.StreamResponse:
        return json_response(self.function_tools())

    def _tool_endpoint(self, spec: ToolSpec) -> Any:
        async def handler(ctx: RequestContext) -> web.StreamResponse:
            session = ctx.existing_session()
            try:
                result = await spec.call(self, session, await ctx.json())
            except HttpError as exc:
                _note_fault(session, spec.name, exc.status, exc.payload)
                raise
            response = _tool_response(result)
            _note_fault(session, spec.name, response.status, getattr(response, "text", ""))
            return response

        return handler

    async def _aggregate_endpoint(self, ctx: RequestContext) -> web.StreamResponse:
        body = await ctx.json_object()
        responses = body.get("verify_responses")
        if not isinstance(responses, list) or not all(isinstance(r, dict) for r in responses):
            raise HttpError(
                422,
                {
                    "detail": [
                        {"type": "list_type", "loc": ["body", "verify_responses"], "msg": "list of objects"}
                    ]
                },
            )
        return json_response(aggregate_metrics(responses, self.compute_metrics(responses)))


# ------------------------------------------------------------------ helpers
def _note_fault(session: Session, tool: str, status: int, body: Any) -> None:
    """Remember a tool answer that is an environment fault (502, 503, ...) for ``verify``."""
    if status_fault_kind(status) is not None:
        detail = body if isinstance(body, str) else orjson.dumps(body, default=repr).decode()
        session.faults.append(env_fault(f"/{tool}", tool=tool, status=status, body=detail))


def _require_keys(body: dict[str, Any], keys: tuple[str, ...]) -> None:
    missing = [
        {"type": "missing", "loc": ["body", k], "msg": "Field required", "input": None}
        for k in keys
        if not isinstance(body.get(k), dict)
    ]
    if missing:
        raise HttpError(422, {"detail": missing})


def _as_verify_result(value: Any) -> VerifyResult:
    if isinstance(value, VerifyResult):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return VerifyResult(reward=float(value))
    if isinstance(value, dict) and "reward" in value:
        extra = dict(value)
        return VerifyResult(
            reward=float(extra.pop("reward")),
            reward_components=extra.pop("reward_components", None),
            mask_sample=bool(extra.pop("mask_sample", False)),
            failure_kind=extra.pop("failure_kind", None),
            failure_reason=extra.pop("failure_reason", None),
            extra=extra,
        )
    raise TypeError(
        f"verify must return VerifyResult, a float or a dict with 'reward'; got {type(value).__name__}"
    )


def _verify_payload(server: str, body: dict[str, Any], result: VerifyResult) -> dict[str, Any]:
    reward = float(result.reward)
    if not math.isfinite(reward):
        raise ValueError(f"{server}.verify returned a non-finite reward {reward!r}")
    payload = {**body, **result.extra, "reward": reward}
    if result.reward_components is not None:
        components = {k: float(v) for k, v in result.reward_components.items()}
        total = math.fsum(components.values())
        if not math.isclose(total, reward, rel_tol=1e-6, abs_tol=1e-6):
            raise ValueError(f"{server}.verify: reward_components sum to {total}, reward is {reward}")
        payload["reward_components"] = components
    payload["mask_sample"] = result.mask_sample
    payload["failure_kind"] = result.failure_kind
    payload["failure_reason"] = result.failure_reason
    return payload


def _tool_response(result: Any) -> web.StreamResponse:
    if isinstance(result, web.StreamResponse):
        return result
    if isinstance(result, ToolOutput):
        return json_response(result.parts(), headers={PARTS_HEADER: "parts"})
    if isinstance(result, str):
        return web.Response(text=result, content_type="text/plain")
    dump = getattr(result, "model_dump", None)
    if callable(dump):
        return json_response(dump(mode="json"))
    return json_response(result)


def aggregate_metrics(responses: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Stock Gym's aggregate shape: per-task groups, overall agent metrics, key metrics.

    As 0.7.0's ``compute_aggregate_metrics``: the reward metrics are over the scored responses
    only; a ``mask_sample`` response (its reward is not a measurement: an environment fault, an
    unavailable judge) counts in ``num_rollouts`` and ``num_masked``, never in a mean.
    """
    by_task: dict[Any, list[float]] = defaultdict(list)
    rewards: list[float] = []
    for r in responses:
        if r.get("mask_sample") is True:
            continue
        reward = r.get("reward")
        if isinstance(reward, (int, float)) and not isinstance(reward, bool):
            rewards.append(float(reward))
            by_task[r.get("_ng_task_index")].append(float(reward))
    groups = [
        {
            "_ng_task_index": task,
            "num_rollouts": len(values),
            "mean/reward": sum(values) / len(values),
            "max/reward": max(values),
            "min/reward": min(values),
        }
        for task, values in by_task.items()
    ]
    mean = sum(rewards) / len(rewards) if rewards else 0.0
    masked = sum(1 for r in responses if r.get("mask_sample") is True)
    agent = {
        "num_rollouts": len(responses),
        "mean/reward": mean,
        "num_masked": masked,
        **(extra or {}),
    }
    return {"group_level_metrics": groups, "agent_metrics": agent, "key_metrics": {"mean/reward": mean}}
