"""What a run reports: one :class:`StepReport` per step, one :class:`RunSummary` at the end.

:meth:`GRPORun.step <gymbridge.run.recipe.GRPORun.step>` builds a :class:`StepReport` from what
the step itself returned (the bridge's :class:`~gymbridge.bridge.BridgeBatch`, the trainer's
:class:`~gymbridge.trainer.StepMetrics`, the publication's seconds, the phase timings) and hands
it to every callback; nothing downstream reads counters off the bridge or the trainer.
:meth:`StepReport.record` is the step's one ``metrics.jsonl`` line: adding a metric is adding it
there.

Invariants: a record holds every :class:`~gymbridge.trainer.StepMetrics` field as is, plus the
run's keys below; the ``timing/<phase>`` keys hold the step's phases in seconds
(:mod:`gymbridge.run.timing`), and they add up to ``step_s`` (``timing/other`` is the rest). A run
whose rows name their environment (``agent_ref``: ``env.mix``, ``env.head_url``) adds
``env/<name>/reward_mean``, ``env/<name>/rollouts_ok``, ``env/<name>/rollouts_failed`` and
``env/<name>/tokens`` for every environment it has run so far (:meth:`StepReport.env_keys`).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from gymbridge.bridge import BridgeBatch, GroupResult
    from gymbridge.metrics import BoundaryTotals
    from gymbridge.trainer.grpo import StepMetrics

__all__ = ["ENV_KEY_PREFIX", "RunSummary", "StepReport", "env_key", "group_rewards", "payload_delta"]

ENV_KEY_PREFIX = "env/"
"""Per-environment keys of a record are ``env/<name>/<metric>``."""


def env_key(env: str, metric: str) -> str:
    """The record key of ``metric`` for environment ``env``: ``env/<env>/<metric>``."""
    return f"{ENV_KEY_PREFIX}{env}/{metric}"


def payload_delta(
    before: Mapping[str, BoundaryTotals], after: Mapping[str, BoundaryTotals]
) -> dict[str, dict[str, int]]:
    """Bytes recorded per boundary between two :meth:`~gymbridge.metrics.PayloadMeter.report` s."""
    out: dict[str, dict[str, int]] = {}
    for name, t in after.items():
        b = before.get(name)
        out[name] = {
            "serialized_bytes": t.serialized_bytes - (b.serialized_bytes if b else 0),
            "physical_media_bytes": t.physical_media_bytes - (b.physical_media_bytes if b else 0),
            "logical_media_bytes": t.logical_media_bytes - (b.logical_media_bytes if b else 0),
        }
    return out


def group_rewards(groups: list[GroupResult]) -> tuple[float, float]:
    """Mean environment reward and mean shaping bonus over the trained trajectories of ``groups``."""
    env: list[float] = []
    bonus: list[float] = []
    for g in groups:
        if g.batch is None:
            continue
        for traj in g.trajectories:
            base = float(traj.metadata.get("env_reward", traj.reward))
            env.append(base)
            bonus.append(float(traj.reward) - base)
    if not env:
        return 0.0, 0.0
    return sum(env) / len(env), sum(bonus) / len(bonus)


def _env_groups(groups: list[GroupResult]) -> dict[str, list[GroupResult]]:
    """The trained groups of each environment (``GroupResult.env``; a group is one row's, so one env's)."""
    out: dict[str, list[GroupResult]] = {}
    for g in groups:
        if g.env is not None and g.batch is not None:
            out.setdefault(g.env, []).append(g)
    return out


@dataclass(frozen=True)
class StepReport:
    """One step of a run, as every callback sees it."""

    step: int
    total_steps: int
    metrics: StepMetrics
    """The trainer's metrics (``policy_version`` and ``weight_sync_s`` filled in)."""
    batch: BridgeBatch
    """The batch trained, its groups and the groups dropped while it was assembled."""
    policy_version: int
    """The trainer's version after the step (the one published, if any)."""
    published: bool
    """Whether new weights went to the generator after this step."""
    weight_sync_s: float
    step_s: float
    """Wall seconds of the step: from the moment the previous step's record was made (the first
    step: from its call) to the moment this one's was (:mod:`gymbridge.run.timing`)."""
    env_reward_mean: float
    shaping_reward_mean: float
    shaped: bool
    """Whether the run adds toy shaping to the environment's reward."""
    payload: dict[str, dict[str, int]] = field(default_factory=dict)
    """Bytes each boundary recorded during this step (:func:`payload_delta`)."""
    timing: dict[str, float] = field(default_factory=dict)
    """Seconds per phase of the step (:data:`gymbridge.run.timing.PHASES`, summing to ``step_s``)."""
    dp: dict[str, Any] = field(default_factory=dict)
    """Data-parallel keys (``dp_backend``, ``dp_world_size``, ``dp_shard_tokens``, ...); ``{}`` without."""
    trainer: dict[str, Any] = field(default_factory=dict)
    """The trainer's fixed facts (``kl_reference``, ``lora_rank``, ``trainable_params``); ``{}`` without."""
    generator: dict[str, Any] = field(default_factory=dict)
    """The model server's counters of the step (``generator/tool_calls_parsed``,
    ``generator/tool_calls_unparsed``; with a fleet ``generator/replica_<i>/...`` and
    ``generator/fleet/...``: :func:`gymbridge.run.timing.generator_keys`); ``{}``: none read."""
    counters_unavailable: dict[str, str] = field(default_factory=dict)
    """Counter sources that could not be read (name -> why): their phases are in ``wait_rollouts``
    (:attr:`gymbridge.run.timing.StepCounters.unavailable`)."""

    @property
    def skipped(self) -> str | None:
        """Why the optimizer did not step (``StepMetrics.skipped``), or ``None``."""
        return self.metrics.skipped

    @property
    def rollouts_truncated(self) -> int:
        """Successful rollouts of the step that ended truncated (trained or dropped groups)."""
        b = self.batch
        return sum(
            t.truncated
            for g in (*b.groups, *b.dropped_stale, *b.dropped_zero_variance)
            for t in g.trajectories
        )

    def record(self) -> dict[str, Any]:
        """The step's ``metrics.jsonl`` record (module docstring).

        Beside the :class:`~gymbridge.trainer.StepMetrics` fields: ``task_indices`` (the rows
        trained, batch order), ``media_keys`` (content keys of the trained media, sorted, each
        once), ``media_tensors`` (the batch's media tensors by modality),
        ``groups_zero_variance_dropped`` / ``zero_variance_task_indices`` (groups dynamic
        sampling left out, each also in ``failures.jsonl``), ``staleness_max`` (the largest
        ``policy version - oldest turn version`` among the trained groups), ``rollouts_truncated``
        (of ``rollouts_ok``), ``counters_unavailable``, ``payload``, one ``timing/<phase>`` key
        per phase of :attr:`timing` and the model server's ``generator/*`` counters.
        """
        groups = self.batch.groups
        keys: set[str] = set()
        for g in groups:
            for traj in g.trajectories:
                for turn in traj.turns:
                    keys.update(m.key for m in turn.media)
        record: dict[str, Any] = {"step": self.step}
        record.update(self.metrics.as_dict())
        record.update(
            {
                "policy_version": self.policy_version,
                "published": self.published,
                "env_reward_mean": self.env_reward_mean,
                "shaping_reward_mean": self.shaping_reward_mean,
                "staleness_max": max((g.staleness for g in groups), default=0),
                "rollouts_ok": self.batch.rollouts_ok,
                "rollouts_failed": self.batch.rollouts_failed,
                "rollouts_truncated": self.rollouts_truncated,
                "groups_dropped_stale": len(self.batch.dropped_stale),
                "groups_zero_variance": sum(_zero_variance(g) for g in groups),
                "groups_zero_variance_dropped": len(self.batch.dropped_zero_variance),
                "zero_variance_task_indices": [g.task_index for g in self.batch.dropped_zero_variance],
                "task_indices": self.batch.task_indices,
                "media_keys": sorted(keys),
                "media_tensors": self.batch.batch.media_keys(),
                "weight_sync_s": self.weight_sync_s,
                "step_s": self.step_s,
                "payload": {k: dict(v) for k, v in self.payload.items()},
                "counters_unavailable": dict(self.counters_unavailable),
                **{f"timing/{phase}": seconds for phase, seconds in self.timing.items()},
                **self.dp,
                **self.trainer,
                **self.generator,
                **self.env_keys(),
            }
        )
        return record

    def env_keys(self) -> dict[str, Any]:
        """The step per environment (``{}`` when the rows name none), for every environment the run has
        run so far: ``env/<name>/reward_mean`` (the environment reward of its trained rollouts;
        ``None`` when none of its groups trained this step), ``env/<name>/rollouts_ok`` and
        ``env/<name>/rollouts_failed`` (as ``rollouts_ok`` / ``rollouts_failed``: while the batch was
        assembled) and ``env/<name>/tokens`` (tokens its trained rollouts generated)."""
        b = self.batch
        trained = _env_groups(b.groups)
        envs = sorted({*b.env_rollouts_ok, *b.env_rollouts_failed, *trained})
        out: dict[str, Any] = {}
        for env in envs:
            groups = trained.get(env, [])
            trajs = [t for g in groups for t in g.trajectories]
            rewards = [float(t.metadata.get("env_reward", t.reward)) for t in trajs]
            out[env_key(env, "reward_mean")] = sum(rewards) / len(rewards) if rewards else None
            out[env_key(env, "rollouts_ok")] = b.env_rollouts_ok.get(env, 0)
            out[env_key(env, "rollouts_failed")] = b.env_rollouts_failed.get(env, 0)
            out[env_key(env, "tokens")] = sum(
                len(turn.generation_token_ids) for t in trajs for turn in t.turns
            )
        return out


def _zero_variance(group: GroupResult) -> bool:
    from gymbridge.bridge.iterator import zero_variance

    return zero_variance(group)


@dataclass
class RunSummary:
    """What a run did, at its end (what the console's last lines print; kept for tests and scripts).

    Bounded: a run of 10,000 steps holds what one of 300 holds, plus one float a step. The per-step
    objects (``steps``, ``records``, ``media_keys``) keep the newest :attr:`window` steps (every
    step's record is in ``metrics.jsonl``); the end summary's totals and medians are counted as the
    steps go (``steps_done``, ``steps_skipped``, :attr:`step_seconds`).
    """

    window: ClassVar[int] = 256
    """Steps whose :class:`~gymbridge.trainer.StepMetrics`, record and media keys are kept."""

    run_dir: str = ""
    steps: deque[StepMetrics] = field(default_factory=lambda: deque(maxlen=RunSummary.window))
    """This process's newest steps (a resumed run: of the steps it ran)."""
    env_rewards: list[float] = field(default_factory=list)
    """Mean environment reward of each step's trained rollouts (every step of this process)."""
    shaping_rewards: list[float] = field(default_factory=list)
    """Mean shaping bonus of each step's trained rollouts (0.0 without shaping)."""
    media_keys: deque[dict[str, list[str]]] = field(default_factory=lambda: deque(maxlen=RunSummary.window))
    """The newest steps' trained media tensors by modality (``TrainBatch.media_keys()``)."""
    records: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=RunSummary.window))
    """This process's newest ``metrics.jsonl`` records."""
    steps_done: int = 0
    """Steps this process ran."""
    steps_skipped: int = 0
    """Of those, steps that did not step the optimizer (``skipped``)."""
    step_seconds: dict[str, array[float]] = field(default_factory=dict)
    """``step_s`` and each ``timing/<phase>`` of every timed step (one float a step each)."""
    rollouts_ok: int = 0
    rollouts_failed: int = 0
    rollouts_truncated: int = 0
    """Summed over the steps' records (``rollouts_truncated``)."""
    rollouts_ok_recorded: int = 0
    """Summed over the steps' records (``rollouts_ok``: the trained rollouts)."""
    counters_missing: dict[str, tuple[int, str]] = field(default_factory=dict)
    """A counter source that went missing -> (the first step without it, why)."""
    bridge_stats: dict[str, Any] = field(default_factory=dict)
    payload_table: str = ""
    model_media_cache: dict[str, Any] = field(default_factory=dict)
    """The model server's media cache counters at the end (``GET /media_cache``; Gym path)."""
    urls: dict[str, str] = field(default_factory=dict)
    """The servers the run started (all stopped when it returns)."""
    resumed_from_step: int = 0
    elapsed_s: float = 0.0
    model_server_pid: int | None = None
    """The child model server's pid with ``generator.placement: process`` (stopped on return)."""
    nothing_to_do: bool = False
    """A resumed run that had already done all its steps (it started nothing)."""
    export_dir: str = ""
    """The Hugging Face export of the final checkpoint (``output.export: final``; ``""``: none written)."""
    env_reward_spans: dict[str, tuple[float, float, int]] = field(default_factory=dict)
    """Per environment (``env/<name>/reward_mean``): its first and last step's mean environment
    reward, and the steps that trained it."""

    def add(self, report: StepReport, record: dict[str, Any]) -> None:
        """Account one step."""
        self.steps.append(report.metrics)
        self.env_rewards.append(report.env_reward_mean)
        suffix = "/reward_mean"
        for key, value in record.items():
            if key.startswith(ENV_KEY_PREFIX) and key.endswith(suffix) and value is not None:
                env = key[len(ENV_KEY_PREFIX) : -len(suffix)]
                first, _, trained = self.env_reward_spans.get(env, (float(value), 0.0, 0))
                self.env_reward_spans[env] = (first, float(value), trained + 1)
        self.shaping_rewards.append(report.shaping_reward_mean)
        self.media_keys.append(report.batch.batch.media_keys())
        self.records.append(record)
        self.steps_done += 1
        self.steps_skipped += record.get("skipped") is not None
        self.rollouts_truncated += int(record.get("rollouts_truncated", 0))
        self.rollouts_ok_recorded += int(record.get("rollouts_ok", 0))
        for name, why in (record.get("counters_unavailable") or {}).items():
            self.counters_missing.setdefault(name, (int(record.get("step", 0)), str(why)))
        if "timing/other" in record:
            for key, value in record.items():
                if key == "step_s" or key.startswith("timing/"):
                    self.step_seconds.setdefault(key, array("d")).append(float(value))

    def warnings(self) -> list[str]:
        """What a user must see at the end: most rollouts truncated, counters that went missing."""
        out: list[str] = []
        truncated, ok = self.rollouts_truncated, self.rollouts_ok_recorded
        if ok and 2 * truncated > ok:
            out.append(
                f"warning: {truncated} of {ok} rollouts ended truncated ({self.steps_skipped} of "
                f"{self.steps_done} step(s) skipped): they stopped at a limit (rollout.max_tokens, the "
                "episode's step cap) before the environment could reward them"
            )
        for name, (step, why) in self.counters_missing.items():
            out.append(
                f"warning: no timing counters from the {name} since step {step} ({why}): "
                "its phases are counted in timing/wait_rollouts"
            )
        return out
