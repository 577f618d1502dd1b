"""Request and response bodies of the NeMo Gym endpoints.

Agent: ``POST /run`` takes a :class:`RunRequest` (a dataset row) and returns a
:class:`RunResult` (the verify result: row echo + ``response`` + ``reward`` + 0.7.0's
``mask_sample`` / ``failure_kind`` / ``failure_reason``; gymnasium_agent adds
``terminated`` / ``truncated`` / ``info``).

Resources server: ``/seed_session`` (body: the row; answer ``{}`` or state),
``/verify`` (:class:`VerifyRequest` -> :class:`VerifyResponse`, optional
``reward_components``), ``/aggregate_metrics``
(:class:`AggregateMetricsRequest` -> :class:`AggregateMetrics`). Gymnasium style:
``/reset`` (:class:`ResetRequest` -> :class:`ResetResponse`), ``/step``
(:class:`StepRequest` -> :class:`StepResponse`), ``/close``.

Stock Gym types ``observation`` as a string. gymbridge keeps it a string (a text
rendering, so stock agents keep working) and adds an optional
``observation_content``: a list of content parts (text, image, audio, video) that
gymbridge's own agent prefers.

Row bookkeeping keys start with an underscore on the wire (``_ng_task_index``,
``_ng_rollout_index``, ``_ng_rollout_id``, ``_ng_step_request_id``); the models
expose them as ``task_index`` … and always write the wire names.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from gymbridge.protocol._base import WireModel
from gymbridge.protocol._content import ContentPart
from gymbridge.protocol._responses import Response, ResponsesCreateParams

__all__ = [
    "AgentRef",
    "AggregateMetrics",
    "AggregateMetricsRequest",
    "CloseRequest",
    "CloseResponse",
    "ResetRequest",
    "ResetResponse",
    "RunRequest",
    "RunResult",
    "SeedSessionRequest",
    "SeedSessionResponse",
    "StepRequest",
    "StepResponse",
    "VerifyRequest",
    "VerifyResponse",
]


class AgentRef(WireModel):
    """``{"type": "responses_api_agents", "name": "<agent instance>"}``."""

    name: str
    type: str | None = None


class RunRequest(WireModel):
    """A dataset row / the body of ``POST <agent>/run``: ``responses_create_params`` + any extra keys.

    ``responses_create_params`` may be absent: agents that build the prompt themselves
    (aviary, toolsandbox, verifiers) take rows such as ``{"task_idx": 0}`` and fill it in.
    """

    responses_create_params: ResponsesCreateParams | None = None
    agent_ref: AgentRef | None = None
    task_index: int | None = Field(default=None, alias="_ng_task_index")
    rollout_index: int | None = Field(default=None, alias="_ng_rollout_index")
    rollout_id: str | None = Field(default=None, alias="_ng_rollout_id")


#: The legacy ``/seed_session`` body is the whole row.
SeedSessionRequest = RunRequest


class SeedSessionResponse(WireModel):
    """``/seed_session`` answer: ``{}`` or server-specific state (kept verbatim)."""


class VerifyRequest(RunRequest):
    """The body of ``POST /verify``: the row plus the rollout's ``response``."""

    response: Response


class VerifyResponse(VerifyRequest):
    """What ``/verify`` returns: the request echoed plus ``reward`` and diagnostics.

    ``reward_components`` (multi-objective environments) should sum to ``reward``;
    ``mask_sample`` marks a sample whose reward is not a valid measurement
    (environment/infrastructure failure); ``failure_kind`` / ``failure_reason`` name
    what went wrong.
    """

    reward: float
    reward_components: dict[str, float] | None = None
    mask_sample: bool = False
    failure_kind: str | None = None
    failure_reason: str | None = None
    _emit_fields = ("mask_sample",)


class RunResult(VerifyResponse):
    """What ``POST <agent>/run`` returns (the verify result; gymnasium agents add episode flags)."""

    terminated: bool | None = None
    truncated: bool | None = None
    info: dict[str, Any] | None = None


class AggregateMetricsRequest(WireModel):
    """``{"verify_responses": [...]}``: stripped verify results (at least ``_ng_task_index``, ``reward``)."""

    verify_responses: list[dict[str, Any]]


class AggregateMetrics(WireModel):
    """``/aggregate_metrics`` answer; flat string keys, ready for a metrics logger."""

    group_level_metrics: list[dict[str, Any]] = Field(default_factory=list)
    agent_metrics: dict[str, Any] = Field(default_factory=dict)
    key_metrics: dict[str, Any] = Field(default_factory=dict)
    perf_summary: dict[str, Any] | None = None
    repeat_level_metrics: list[dict[str, Any]] = Field(default_factory=list)
    _emit_fields = ("group_level_metrics", "agent_metrics", "key_metrics")


#: ``POST /reset`` takes the row.
ResetRequest = RunRequest


class ResetResponse(WireModel):
    """``{"observation": str | null, "info": {...}}`` plus gymbridge's ``observation_content``."""

    observation: str | None = None
    info: dict[str, Any] = Field(default_factory=dict)
    observation_content: list[ContentPart] | None = None
    _emit_fields = ("observation", "info")


class StepRequest(RunRequest):
    """``POST /step``: the row plus this turn's ``response``."""

    response: Response
    step_request_id: str | None = Field(default=None, alias="_ng_step_request_id")


class StepResponse(WireModel):
    """``{"observation", "reward", "terminated", "truncated", "info"}`` plus ``observation_content``."""

    observation: str | None = None
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = Field(default_factory=dict)
    observation_content: list[ContentPart] | None = None
    _emit_fields = ("observation", "reward", "terminated", "truncated", "info")


class CloseRequest(WireModel):
    """``POST /close`` body (stock gymnasium_agent sends ``{}``)."""


class CloseResponse(WireModel):
    """``/close`` answer (server-specific, kept verbatim)."""
