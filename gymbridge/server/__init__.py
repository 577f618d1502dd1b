"""Server SDK for NeMo Gym environments on aiohttp: resources servers, the simple agent, check_env.

Public API (stable): :class:`ResourcesServer` with :func:`tool`, :class:`VerifyResult`,
:class:`Observation`, :class:`StepResult`, :class:`ToolOutput` and the content-part
helpers; :class:`SimpleAgent` and :func:`rollout_id_from_row` (stock Gym's rollout id);
:func:`serve` (blocking) and :func:`start_server` (in-loop, for tests);
:func:`tune_gc_for_serving` (what ``serve`` does to the GC, for processes that host
servers with ``start_server``); :func:`check_env`.
See ``docs/http.md``.
"""

from __future__ import annotations

from gymbridge.server._agent import SimpleAgent, rollout_id_from_row
from gymbridge.server._base import (
    GymServer,
    HttpError,
    RunningServer,
    Session,
    free_port,
    serve,
    start_server,
    tune_gc_for_serving,
)
from gymbridge.server._check import CheckEnvError, CheckReport, check_env, example_arguments
from gymbridge.server._resources import (
    Observation,
    ResourcesServer,
    StepResult,
    VerifyResult,
    aggregate_metrics,
)
from gymbridge.server._tools import ToolOutput, ToolSpec, audio_part, image_part, media_part, tool, video_part

__all__ = [
    "CheckEnvError",
    "CheckReport",
    "GymServer",
    "HttpError",
    "Observation",
    "ResourcesServer",
    "RunningServer",
    "Session",
    "SimpleAgent",
    "StepResult",
    "ToolOutput",
    "ToolSpec",
    "VerifyResult",
    "aggregate_metrics",
    "audio_part",
    "check_env",
    "example_arguments",
    "free_port",
    "image_part",
    "media_part",
    "rollout_id_from_row",
    "serve",
    "start_server",
    "tool",
    "tune_gc_for_serving",
    "video_part",
]
