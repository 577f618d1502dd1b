"""Where a run's step time goes: the ``timing/*`` keys of every ``metrics.jsonl`` line.

:meth:`GRPORun.step <gymbridge.run.recipe.GRPORun.step>` measures a few wall intervals itself (the
wait for the batch, the update, the publication, the previous step's reporting and checkpoint)
and reads the components' own counters: the bridge's :class:`~gymbridge.bridge.BatchTimings`, the
model server's and the agent's :class:`~gymbridge.metrics.PhaseTimer` snapshots
(:class:`StepCounters`) and the trainer's :class:`~gymbridge.trainer.StepMetrics`.
:func:`split_step` turns them into phases (``wait_rollouts``, ``generation``, ``env_*``,
``postprocess``, ``batch_build``, ``forward_backward``, ``optimizer``, ``weight_sync``,
``artifacts``, ``checkpoint``, ``other``).

Invariants:

* the phases add up to the step's wall seconds ``step_s``, and the steps' ``step_s`` add up to the
  loop's wall time (a step runs from the previous step's record to its own, so its reporting and
  checkpoint are counted in the next step);
* the wait for the batch is split in a fixed order, each phase at most what is left of it;
  overlapping busy seconds are counted once, in the earlier phase; the rest is ``wait_rollouts``;
* ``other`` is ``step_s`` minus every other phase: shown, never hidden.

What each phase holds: docs/timing.md.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gymbridge.metrics import timing_delta

if TYPE_CHECKING:
    from gymbridge.bridge import BatchTimings

logger = logging.getLogger(__name__)

__all__ = [
    "ENV_PHASES",
    "FLEET_GAUGES",
    "GENERATOR_COUNTERS",
    "PHASES",
    "CounterSource",
    "StepCounters",
    "generator_keys",
    "median_split",
    "split_step",
]

ENV_PHASES = ("env_seed", "env_tool", "env_step", "env_verify", "env_other")
"""The agent's environment phases (``SimpleAgent`` counters), in attribution order."""

PHASES = (
    "wait_rollouts",
    "generation",
    *ENV_PHASES,
    "postprocess",
    "batch_build",
    "forward_backward",
    "optimizer",
    "weight_sync",
    "artifacts",
    "checkpoint",
    "other",
)
"""Every phase of :func:`split_step`, in the order charts and the console show them."""

GENERATOR_COUNTERS = ("tool_calls_parsed", "tool_calls_unparsed")
"""Model-server counters a step's record carries as ``generator/<name>`` (:func:`generator_keys`):
tool calls that parsed, and markup that looked like a tool call but did not (``tool_call_unparsed``,
:mod:`gymbridge.generation.tool_calls`)."""


FLEET_GAUGES = ("in_flight", "state", "policy_version", "sync_s", "healthy")
"""Fleet counters (:mod:`gymbridge.generation.router`) read as they are at the step's end, not as a
delta: ``replica_<i>/in_flight``, ``/state``, ``/policy_version``, ``/sync_s`` and ``fleet/healthy``.
The others (``requests``, ``errors``, ``retried``, ``restarts``, ``fleet/lost``) count the step."""


def _is_fleet_key(key: str) -> bool:
    return key.startswith(("replica_", "fleet/"))


def _is_gauge(key: str) -> bool:
    return _is_fleet_key(key) and key.rsplit("/", 1)[-1] in FLEET_GAUGES


def generator_keys(model: Mapping[str, float]) -> dict[str, Any]:
    """``generator/<name>`` for each of :data:`GENERATOR_COUNTERS` in ``model`` (the model server
    counters' delta over the step), and with a fleet ``generator/replica_<i>/<name>`` (``requests``,
    ``errors``, ``retried``, ``restarts`` of the step; ``in_flight``, ``policy_version``, ``sync_s``
    and ``state``, a name such as ``HEALTHY``, at its end) and ``generator/fleet/healthy`` /
    ``generator/fleet/lost``. A key is absent where no model server counts it (native rollouts, a
    model server of another kind, one model server), never reported as 0."""
    from gymbridge.generation.router import STATE_NAMES

    out: dict[str, Any] = {
        f"generator/{name}": float(model[name]) for name in GENERATOR_COUNTERS if name in model
    }
    for key in sorted(k for k in model if _is_fleet_key(k)):
        value = model[key]
        name = key.rsplit("/", 1)[-1]
        if name == "state":
            out[f"generator/{key}"] = STATE_NAMES.get(int(value), str(value))
        elif name == "sync_s":
            out[f"generator/{key}"] = float(value)
        else:
            out[f"generator/{key}"] = int(value)
    return out


def split_step(
    *,
    step_s: float,
    batch_wait_s: float,
    batch: BatchTimings | None,
    model: Mapping[str, float],
    agent: Mapping[str, float],
    forward_backward_s: float,
    optimizer_s: float,
    update_s: float,
    weight_sync_s: float,
    artifacts_s: float,
    checkpoint_s: float,
) -> dict[str, float]:
    """The step's phases in seconds (module docstring), every one of :data:`PHASES`, summing to ``step_s``.

    ``batch_wait_s``: the wall seconds of the bridge's ``next_batch``; ``model`` / ``agent``: the
    counters' deltas over the step (``{}`` when not available); ``update_s``: the wall seconds of
    the update, which bound ``forward_backward_s + optimizer_s``.
    """
    out = dict.fromkeys(PHASES, 0.0)
    left = max(0.0, batch_wait_s)

    def take(phase: str, seconds: float) -> None:
        nonlocal left
        share = min(max(0.0, seconds), left)
        out[phase] = share
        left -= share

    if batch is not None:
        take("postprocess", batch.postprocess_s)
        take("batch_build", batch.build_s + batch.assemble_s)
    take("generation", model.get("compute_busy_s", 0.0))
    for phase in ENV_PHASES:
        take(phase, agent.get(f"{phase}_busy_s", 0.0))
    out["wait_rollouts"] = left
    left = max(0.0, update_s)
    take("forward_backward", forward_backward_s)
    take("optimizer", optimizer_s)
    out["weight_sync"] = max(0.0, weight_sync_s)
    out["artifacts"] = max(0.0, artifacts_s)
    out["checkpoint"] = max(0.0, checkpoint_s)
    out["other"] = step_s - sum(v for k, v in out.items() if k != "other")
    return out


class CounterSource:
    """One component's counters: an in-process ``counters()`` or a ``GET <url>/counters``.

    A source that cannot answer (an agent of the user's own without ``/counters``, a server
    gone) warns once, keeps why in :attr:`unavailable` and answers ``{}`` from then on: a step's
    split never fails the step, and every step's record says the source is missing
    (:attr:`StepCounters.unavailable`), so its time moving to ``wait_rollouts`` is never silent.
    """

    def __init__(
        self, name: str, *, local: Callable[[], Mapping[str, float]] | None = None, url: str | None = None
    ):
        self.name = name
        self._local = local
        self._url = url.rstrip("/") + "/counters" if url else None
        self._off = local is None and url is None
        self.unavailable: str | None = None
        """Why the source stopped answering (``None`` while it answers, or when it has no counters)."""

    async def read(self, http: Any) -> dict[str, float]:
        if self._off:
            return {}
        try:
            if self._local is not None:
                return dict(self._local())
            reply = await http.get(self._url)
            if reply.status_code != 200:
                raise ValueError(f"HTTP {reply.status_code}")
            body = reply.json()
            if not isinstance(body, dict):
                raise ValueError("not a JSON object")
            return {str(k): float(v) for k, v in body.items() if isinstance(v, int | float)}
        except Exception as exc:  # counters are diagnostics: never fail a step over them
            logger.warning(
                "%s counters unavailable (%s); its phases are counted in wait_rollouts", self.name, exc
            )
            self._off = True
            self.unavailable = f"{type(exc).__name__}: {exc}"
            return {}


class StepCounters:
    """The model server's and the agent's counters, read at each step boundary (deltas per step)."""

    def __init__(self, model: CounterSource | None = None, agent: CounterSource | None = None) -> None:
        self.model = model
        self.agent = agent
        self._http: Any = None
        self._before: tuple[dict[str, float], dict[str, float]] | None = None

    async def _read(self) -> tuple[dict[str, float], dict[str, float]]:
        remote = [s for s in (self.model, self.agent) if s is not None and s._url is not None]
        if remote and self._http is None:
            import httpx

            self._http = httpx.AsyncClient(timeout=5.0, trust_env=False)
        model = await self.model.read(self._http) if self.model is not None else {}
        agent = await self.agent.read(self._http) if self.agent is not None else {}
        return model, agent

    @property
    def unavailable(self) -> dict[str, str]:
        """The sources that stopped answering: name -> why (each step's ``counters_unavailable``)."""
        return {s.name: s.unavailable for s in (self.model, self.agent) if s is not None and s.unavailable}

    async def start(self) -> None:
        """Read the counters at the start of a step window (when no earlier :meth:`delta` did)."""
        if self._before is None:
            self._before = await self._read()

    async def delta(self) -> tuple[dict[str, float], dict[str, float]]:
        """The model's and the agent's counters since the last call (or :meth:`start`)."""
        after = await self._read()
        before = self._before or ({}, {})
        self._before = after
        model = timing_delta(after[0], before[0])
        model.update({k: v for k, v in after[0].items() if _is_gauge(k)})  # a fleet's gauges: as they are
        return model, timing_delta(after[1], before[1])

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None


def median_split(steps: Sequence[Mapping[str, Any]] | Mapping[str, Sequence[float]]) -> str:
    """One line: the median ``step_s`` and the median seconds of every phase that took any time.

    ``steps``: the timed steps' records, or their columns (``{"step_s": [...], "timing/<phase>":
    [...]}``, :attr:`~gymbridge.run.report.RunSummary.step_seconds`: one float a step)."""
    if isinstance(steps, Mapping):
        columns = steps
    else:
        timed = [r for r in steps if "timing/other" in r]
        keys = ("step_s", *(f"timing/{p}" for p in PHASES))
        columns = {k: [float(r.get(k, 0.0)) for r in timed] for k in keys}
    step_s = columns.get("step_s") or []
    if not step_s:
        return ""
    step = statistics.median(step_s)
    parts = []
    for phase in PHASES:
        values = columns.get(f"timing/{phase}") or []
        if any(values):
            parts.append(f"{phase} {statistics.median(values):.3f}")
    return f"step time, median of {len(step_s)} step(s): {step:.3f}s; per phase (s): " + ", ".join(parts)
