"""``BridgeIterator``: dataset rows -> G rollouts per prompt -> group advantages -> ``TrainBatch``.

One prompt (dataset row) becomes ``group_size`` rollouts through a
:class:`~gymbridge.bridge.sources.RolloutSource` (the Gym path or the native path); each result is
postprocessed once by :func:`~gymbridge.trajectory.from_gym_result`; a complete group becomes one
per-group :class:`~gymbridge.tensors.TrainBatch` (media processed once per content key, group
advantages computed), and ``prompts_per_step`` groups are concatenated into the batch that
:meth:`~BridgeIterator.next_batch` returns as a :class:`BridgeBatch`. Sync iteration runs on a
private event loop, async iteration on the caller's.

Invariants:

* **nothing disappears**: every rollout is a trajectory in a yielded batch, a failure record, or
  listed in its group's record; every prompt is a group in a batch or a group record, so
  ``stats.prompts_started`` equals the groups completed, failed and dropped (every kind) once the
  iterator is drained or stopped;
* any exception of one rollout is that rollout's failure record, never an exception through the
  iterator; a group is completed from at least ``min_group_size`` successful rollouts, else it
  fails (never trained on); a rollout that generated a media placeholder token is a failure;
* the iterator never yields an empty batch: ``max_consecutive_failed_groups`` failed groups in a
  row, or a dataset without a completed group, raise :class:`BridgeStalledError`;
* **bounded staleness** (``max_staleness = k``): nothing runs more than ``k`` batches ahead, and a
  group more than ``k`` versions behind :attr:`BridgeIterator.policy_version` is dropped as
  ``stale`` (or, with ``drop_stale=False`` on-policy, handed on for the drift guard to fail);
* :attr:`BridgeIterator.done_task_indices` is the resumable position; ``skip_task_indices`` are
  never started again; rows are never mutated;
* a row naming its environment (``agent_ref``: :func:`~gymbridge.client.env_of_row`) makes a group
  of that environment (:attr:`GroupResult.env`; a group is one row's, so never of two), its
  failure records carry ``env``, and :class:`BridgeStats` / :class:`BridgeBatch` count its
  rollouts per environment.

Dynamic sampling, the failure records and the statistics in detail: docs/bridge.md ("Library
API") and docs/grpo.md ("Dynamic sampling"); staleness and resume: docs/loop.md.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import orjson

from gymbridge.bridge.config import BridgeConfig
from gymbridge.bridge.sources import RolloutRecord, RolloutSource
from gymbridge.client import env_of_row
from gymbridge.errors import BridgeStalledError, GeneratorFleetError, TrajectoryError
from gymbridge.rowset import RowSet
from gymbridge.tensors.batch import BATCH_ADVANTAGE_MODES

if TYPE_CHECKING:
    from gymbridge.media import MediaPolicy
    from gymbridge.metrics import PayloadMeter
    from gymbridge.tensors import MediaProcessor, TrainBatch
    from gymbridge.trajectory import Trajectory

logger = logging.getLogger(__name__)

__all__ = [
    "BatchTimings",
    "BridgeBatch",
    "BridgeIterator",
    "BridgeStalledError",
    "BridgeStats",
    "GroupResult",
    "read_rows",
    "zero_variance",
]


@dataclass
class BridgeStats:
    """Counters over the iterator's life (``rollouts_*`` per rollout, ``groups_*`` per prompt)."""

    prompts_started: int = 0
    groups_completed: int = 0
    groups_partial: int = 0
    """Completed groups that lost some rollouts (completed from the successful ones)."""
    groups_failed: int = 0
    groups_dropped: int = 0
    """Completed groups of a final partial batch discarded by ``drop_last`` (each recorded)."""
    groups_zero_variance: int = 0
    """Completed groups whose rewards are all equal (zero advantages: no learning signal)."""
    groups_dropped_stale: int = 0
    """Groups older than ``max_staleness`` policy versions when their batch was asked for (recorded)."""
    groups_zero_variance_dropped: int = 0
    """Zero-variance groups dynamic sampling left out of their batch (recorded, replaced by new prompts)."""
    rollouts_ok: int = 0
    rollouts_failed: int = 0
    rollouts_dropped: int = 0
    """Successful rollouts of failed or ``drop_last`` groups (listed in the group record's
    ``dropped_rollouts``)."""
    rollouts_masked: int = 0
    """Successful rollouts the environment marked ``mask_sample`` (kept, loss-masked)."""
    rollouts_cancelled: int = 0
    """Rollouts of groups cancelled in flight when the iterator stopped (each a ``cancelled`` record;
    not in ``rollouts_failed``: stopping a run that works ahead is not a failure)."""
    batches: int = 0
    failure_classes: dict[str, int] = field(default_factory=dict)
    env_rollouts_ok: dict[str, int] = field(default_factory=dict)
    """``rollouts_ok`` per environment (rows that name one, ``agent_ref``)."""
    env_rollouts_failed: dict[str, int] = field(default_factory=dict)
    """``rollouts_failed`` per environment (rows that name one, ``agent_ref``)."""

    def count_ok(self, env: str | None, delta: int = 1) -> None:
        """Count ``delta`` successful rollouts (of ``env``'s row, when it names one)."""
        self.rollouts_ok += delta
        if env is not None:
            self.env_rollouts_ok[env] = self.env_rollouts_ok.get(env, 0) + delta

    def as_dict(self) -> dict[str, Any]:
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class GroupResult:
    """One prompt's outcome: its per-group batch, or ``None`` with the failures that sank it."""

    task_index: int
    batch: TrainBatch | None
    trajectories: list[Trajectory]
    failures: list[dict[str, Any]]
    rewards: list[float]
    elapsed_s: float
    started_version: int = 0
    """:attr:`BridgeIterator.policy_version` when the group's rollouts started."""
    staleness: int = 0
    """Policy versions between the oldest turn of the group and the version that consumed it."""
    rollouts_s: float = 0.0
    """Wall seconds the source took for the group's rollouts (``source.rollouts``)."""
    postprocess_s: float = 0.0
    """Seconds spent turning the group's results into trajectories (on the event loop)."""
    build_s: float = 0.0
    """Seconds spent building the group's batch: media processing, dedup, advantages (on the loop)."""
    env: str | None = None
    """The environment the group's row names (``agent_ref``); ``None``: it names none."""


@dataclass(frozen=True)
class BatchTimings:
    """Where the bridge's time went for one yielded batch (:attr:`BridgeBatch.timings`).

    ``postprocess_s``, ``build_s`` and ``assemble_s`` are synchronous work on the event loop, so
    they never overlap one another: their sum is wall time the loop spent. ``rollouts_s`` sums
    the groups' rollout wall times, which run concurrently (it can exceed ``wait_s``). Every
    group consumed for the batch counts, dropped ones (stale, zero-variance, failed) included.
    """

    wait_s: float = 0.0
    """Wall seconds of the ``__anext__`` call that produced the batch (the caller's wait)."""
    rollouts_s: float = 0.0
    postprocess_s: float = 0.0
    build_s: float = 0.0
    assemble_s: float = 0.0
    """Concatenating the groups' batches into the yielded one (``TrainBatch.cat(..., renumber=True)``)."""
    groups: int = 0
    """Groups consumed for the batch (trained or dropped)."""
    rollouts: int = 0
    """Rollouts of those groups that became trajectories."""

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class BridgeBatch:
    """One batch and what a training step reports about it (:meth:`BridgeIterator.next_batch`)."""

    batch: TrainBatch
    groups: list[GroupResult]
    """The groups in ``batch``, in batch order (rewards, trajectories, partial failures)."""
    dropped_stale: list[GroupResult]
    """Groups dropped as ``stale`` while this batch was assembled (each recorded)."""
    dropped_zero_variance: list[GroupResult]
    """Zero-variance groups dynamic sampling left out of this batch (each recorded)."""
    rollouts_ok: int
    """Rollouts that succeeded while this batch was assembled (those of dropped groups included)."""
    rollouts_failed: int
    """Rollouts that failed while this batch was assembled (each recorded)."""
    timings: BatchTimings = field(default_factory=BatchTimings)
    """Where the bridge's time went for this batch (:class:`BatchTimings`)."""
    env_rollouts_ok: dict[str, int] = field(default_factory=dict)
    """``rollouts_ok`` per environment, for every environment the iterator has run so far (0 included)."""
    env_rollouts_failed: dict[str, int] = field(default_factory=dict)
    """``rollouts_failed`` per environment, for every environment the iterator has run so far."""

    @property
    def task_indices(self) -> list[int]:
        return [g.task_index for g in self.groups]


def read_rows(source: str | Path | Iterable[Mapping[str, Any]]) -> Iterator[Mapping[str, Any] | Exception]:
    """Rows of a jsonl file (lazily, line by line) or of an iterable; a bad line yields its error."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        with path.open("rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = orjson.loads(line)
                except orjson.JSONDecodeError as exc:
                    yield ValueError(f"{path}:{lineno}: not JSON: {exc}")
                    continue
                if not isinstance(row, dict):
                    yield ValueError(
                        f"{path}:{lineno}: a row must be a JSON object, got {type(row).__name__}"
                    )
                    continue
                yield row
        return
    for row in source:
        if not isinstance(row, Mapping):
            yield ValueError(f"a row must be a mapping, got {type(row).__name__}")
            continue
        yield row


def zero_variance(group: GroupResult) -> bool:
    """Whether ``group``'s trainable rollouts (not ``mask_sample``) all have the same reward."""
    return len({t.reward for t in group.trajectories if not t.mask_sample}) <= 1


def _with_env(record: dict[str, Any], env: str | None) -> dict[str, Any]:
    """``record`` with ``env`` (the row's environment) when there is one."""
    if env is not None:
        record["env"] = env
    return record


def _delta(after: Mapping[str, int], before: Mapping[str, int], other: Mapping[str, int]) -> dict[str, int]:
    """``after - before`` per environment, 0 for every environment of ``after`` or ``other`` (run so far)."""
    return {env: after.get(env, 0) - before.get(env, 0) for env in sorted({*after, *other})}


def _rollout_of(traj: Trajectory) -> int:
    return -1 if traj.rollout_index is None else traj.rollout_index


def _oldest_version(traj: Trajectory) -> int | None:
    """The oldest policy version among ``traj``'s turns (``None``: the generator stamps none)."""
    return traj.oldest_policy_version


class BridgeIterator:
    """Iterate ``TrainBatch`` es of ``prompts_per_step`` groups of ``group_size`` rollouts.

    Args:
        rows: a jsonl path or an iterable of dataset rows (stock Gym row shape).
        source: where rollouts come from (:class:`~gymbridge.bridge.GymRollouts` or
            :class:`~gymbridge.bridge.NativeRollouts`).
        processor: processes each group's media once per content key (``None`` for text-only data).
        config: what is trained and how (:class:`~gymbridge.bridge.BridgeConfig`: group size,
            groups per batch, failed groups, staleness, dynamic sampling, advantages, dedup).
        media_policy: what media references may be fetched while postprocessing results.
        failures_path: append every failure record (rollout and group) as one jsonl line.
        meter: payload metrics (``rollout_to_policy`` here; the source records its own).
        placeholder_token_ids: media placeholder ids a rollout must never *generate* (default: the
            processor's image / video / audio placeholders; pass every placeholder the model knows).
        reward_fn: reward shaping (length penalty, format bonus, ...): the trained reward becomes
            ``reward_fn(trajectory)``; the environment's stays in ``metadata["env_reward"]`` and the
            difference is the ``"shaping"`` reward component. A non-finite value fails the rollout.
        skip_task_indices: rows never to start (a resumed run's :attr:`done_task_indices`).
    """

    def __init__(
        self,
        rows: str | Path | Iterable[Mapping[str, Any]],
        source: RolloutSource,
        processor: MediaProcessor | None,
        config: BridgeConfig | None = None,
        *,
        media_policy: MediaPolicy | None = None,
        failures_path: str | Path | None = None,
        meter: PayloadMeter | None = None,
        placeholder_token_ids: Iterable[int] | None = None,
        reward_fn: Callable[[Trajectory], float] | None = None,
        skip_task_indices: Iterable[int] = (),
    ) -> None:
        self.config = config if config is not None else BridgeConfig()
        self.source = source
        self.processor = processor
        self.media_policy = media_policy
        self.failures_path = Path(failures_path) if failures_path is not None else None
        self.meter = meter
        if placeholder_token_ids is None and processor is not None:
            found = (processor.placeholder_token_id(m) for m in ("image", "video", "audio"))
            placeholder_token_ids = [t for t in found if t is not None]
        self.placeholder_token_ids: frozenset[int] = frozenset(placeholder_token_ids or ())
        self.reward_fn = reward_fn
        self.policy_version = 0
        """The trainer's policy version (:meth:`next_batch` sets it; staleness is measured from it)."""
        self.done_task_indices = RowSet()
        """Rows whose group was consumed: trained, failed or dropped (a resume skips them); held as
        ranges, so it does not grow with the rows done."""
        skip = skip_task_indices
        self._skip = skip.copy() if isinstance(skip, RowSet) else RowSet(skip)
        self.stats = BridgeStats()
        self.failures: list[dict[str, Any]] = []
        """The failure records. With ``failures_path`` only the newest ones (at most twice
        :attr:`failures_held`): every record is in that file and counted in :attr:`stats`."""
        self._rows = enumerate(read_rows(rows))
        self._exhausted = False
        self._pending: collections.deque[asyncio.Task[GroupResult]] = collections.deque()
        self._task_index: dict[asyncio.Task[GroupResult], int] = {}
        self._task_env: dict[asyncio.Task[GroupResult], str | None] = {}
        """The environment each pending group's row names (its failure records name it if it stops)."""
        self._consecutive_failed = 0
        self._failures_file: IO[bytes] | None = None
        self._closed = False

    # ------------------------------------------------------------------ failures
    failures_held = 1024
    """With ``failures_path``, :attr:`failures` keeps between this many and twice this many records."""

    def _record(self, record: dict[str, Any], *, env: str | None = None) -> None:
        """Keep (and write) one failure record, naming environment ``env`` when the row names one."""
        _with_env(record, env)
        self.failures.append(record)
        if self.failures_path is not None:
            if len(self.failures) > 2 * self.failures_held:  # streamed to the file: keep the newest
                del self.failures[: -self.failures_held]
            if self._failures_file is None:
                self.failures_path.parent.mkdir(parents=True, exist_ok=True)
                self._failures_file = self.failures_path.open("ab")
            self._failures_file.write(orjson.dumps(record, default=str) + b"\n")
            self._failures_file.flush()

    def _rollout_failure(
        self,
        task_index: int,
        rollout_index: int,
        cls: str,
        reason: str,
        attempts: int,
        *,
        cancelled: bool = False,
        env: str | None = None,
    ) -> dict[str, Any]:
        """Record one rollout that is not trained (``cancelled``: stopped in flight, not a failure) of
        a row of environment ``env`` (``None``: the row names none)."""
        if cancelled:
            self.stats.rollouts_cancelled += 1
        else:
            self.stats.rollouts_failed += 1
            self.stats.failure_classes[cls] = self.stats.failure_classes.get(cls, 0) + 1
            if env is not None:
                failed = self.stats.env_rollouts_failed
                failed[env] = failed.get(env, 0) + 1
        record = {
            "kind": "rollout",
            "task_index": task_index,
            "rollout_index": rollout_index,
            "failure_class": cls,
            "failure_reason": reason,
            "attempts": attempts,
            "time": time.time(),
        }
        self._record(record, env=env)
        return record

    # ------------------------------------------------------------------ one group
    def _postprocess(self, rec: RolloutRecord, env: str | None = None) -> Trajectory | dict[str, Any]:
        from gymbridge.trajectory import from_gym_result

        if rec.result is None:
            return self._rollout_failure(
                rec.task_index,
                rec.rollout_index,
                rec.failure_class or "unknown",
                rec.failure_reason or "",
                rec.attempts,
                env=env,
            )
        try:
            traj = from_gym_result(
                rec.result,
                media_policy=self.media_policy,
                on_noncontiguous=self.config.on_noncontiguous,
                reward_components_check=self.config.reward_components_check,
            )
        except Exception as exc:  # any failure to read one result is that rollout's, not the batch's
            where = (
                f" (output item {exc.item_index})"
                if isinstance(exc, TrajectoryError) and exc.item_index is not None
                else ""
            )
            return self._rollout_failure(
                rec.task_index, rec.rollout_index, type(exc).__name__, f"{exc}{where}", rec.attempts, env=env
            )
        if traj.task_index is None or traj.rollout_index is None:
            traj = replace(
                traj,
                task_index=rec.task_index if traj.task_index is None else traj.task_index,
                rollout_index=rec.rollout_index if traj.rollout_index is None else traj.rollout_index,
            )
        if self.reward_fn is not None:
            try:
                shaped = float(self.reward_fn(traj))
            except Exception as exc:  # a user's shaping function: its failure is this rollout's
                return self._rollout_failure(
                    rec.task_index,
                    rec.rollout_index,
                    "RewardFnError",
                    f"{type(exc).__name__}: {exc}",
                    rec.attempts,
                    env=env,
                )
            if not math.isfinite(shaped):
                return self._rollout_failure(
                    rec.task_index,
                    rec.rollout_index,
                    "RewardFnError",
                    f"reward_fn returned {shaped}",
                    rec.attempts,
                    env=env,
                )
            components = (
                {**traj.reward_components, "shaping": shaped - traj.reward} if traj.reward_components else {}
            )
            traj = replace(
                traj,
                reward=shaped,
                reward_components=components,
                metadata={**traj.metadata, "env_reward": traj.reward},
            )
        bad = self._generated_placeholder(traj)
        if bad is not None:
            return self._rollout_failure(
                rec.task_index, rec.rollout_index, "GeneratedPlaceholderToken", bad, rec.attempts, env=env
            )
        self.stats.count_ok(env)
        if traj.mask_sample:
            self.stats.rollouts_masked += 1
        return traj

    def _generated_placeholder(self, traj: Trajectory) -> str | None:
        """Why ``traj`` cannot be teacher-forced: a *sampled* media placeholder token, or ``None``.

        A model may sample ``<|image_pad|>`` like any token; the VLM would then expect one
        more image feature than the media provide, so the sequence cannot be trained on.
        """
        ids = self.placeholder_token_ids
        if not ids:
            return None
        for turn in traj.turns:
            hit = ids.intersection(turn.generation_token_ids)
            if hit:
                return (
                    f"turn {turn.index} (output item {turn.item_index}) generated media placeholder token(s) "
                    f"{sorted(hit)}: the sequence cannot be teacher-forced against its media"
                )
        return None

    async def _run_group(
        self, task_index: int, row: Mapping[str, Any] | Exception, started_version: int = 0
    ) -> GroupResult:
        started = time.monotonic()
        failures: list[dict[str, Any]] = []
        trajs: list[Trajectory] = []
        rollouts_s = postprocess_s = 0.0
        env = None if isinstance(row, Exception) else env_of_row(row)
        if isinstance(row, Exception):
            for i in range(self.config.group_size):
                failures.append(self._rollout_failure(task_index, i, "bad_row", str(row), 0))
        else:
            try:
                records = await self.source.rollouts(
                    row, task_index=task_index, group_size=self.config.group_size
                )
            except GeneratorFleetError:  # the generator fleet is below its floor: the run stops
                raise
            except Exception as exc:  # a source bug or a setup failure: still data for this prompt
                records = [
                    RolloutRecord(task_index, i, failure_class=type(exc).__name__, failure_reason=str(exc))
                    for i in range(self.config.group_size)
                ]
            if len(records) != self.config.group_size:  # a source bug: every rollout is recorded
                broken = (
                    f"rollout source {type(self.source).__name__} returned {len(records)} records "
                    f"for a group of {self.config.group_size}"
                )
                logger.error("task %d: %s", task_index, broken)
                records = [
                    RolloutRecord(task_index, i, failure_class="source_contract", failure_reason=broken)
                    for i in range(self.config.group_size)
                ]
            rolled = time.perf_counter()
            rollouts_s = time.monotonic() - started
            for rec in records:
                out = self._postprocess(rec, env)
                if isinstance(out, dict):
                    failures.append(out)
                else:
                    trajs.append(out)
            postprocess_s = time.perf_counter() - rolled
        building = time.perf_counter()
        batch: TrainBatch | None = None
        reason: str | None = None
        if len(trajs) >= self.config.min_group:
            try:
                batch = self._build(trajs)
            except Exception as exc:
                # find the culprits one by one: one bad rollout must not sink its whole group
                logger.info(
                    "group of task %d did not build (%s); checking rollouts one by one", task_index, exc
                )
                good: list[Trajectory] = []
                for traj in trajs:
                    try:
                        self._build([traj])
                    except Exception as one:
                        self.stats.count_ok(env, -1)
                        if traj.mask_sample:
                            self.stats.rollouts_masked -= 1
                        failures.append(
                            self._rollout_failure(
                                task_index,
                                _rollout_of(traj),
                                type(one).__name__,
                                str(one),
                                attempts=0,
                                env=env,
                            )
                        )
                    else:
                        good.append(traj)
                trajs = good
                if len(trajs) >= self.config.min_group:
                    try:
                        batch = self._build(trajs)
                    except Exception as again:  # fails only together: give up
                        reason = f"building the group's batch failed: {type(again).__name__}: {again}"
        if batch is None and reason is None:
            reason = (
                f"only {len(trajs)} of {self.config.group_size} rollouts succeeded "
                f"(min_group_size={self.config.min_group})"
            )
        rewards = [t.reward for t in trajs]
        if batch is None:
            self.stats.rollouts_dropped += len(trajs)
            classes: dict[str, int] = collections.Counter(f["failure_class"] for f in failures)
            record = {
                "kind": "group",
                "task_index": task_index,
                "succeeded": len(trajs),
                "group_size": self.config.group_size,
                "failure_class": "group_failed",
                "failure_reason": reason,
                "rollout_failure_classes": dict(classes),
                "dropped_rollouts": [_rollout_of(t) for t in trajs],
                "time": time.time(),
            }
            self._record(record, env=env)
            failures.append(record)
        return GroupResult(
            task_index,
            batch,
            trajs,
            failures,
            rewards,
            time.monotonic() - started,
            started_version,
            rollouts_s=rollouts_s,
            postprocess_s=postprocess_s,
            build_s=time.perf_counter() - building,
            env=env,
        )

    def _build(self, trajs: list[Trajectory]) -> TrainBatch:
        from gymbridge.tensors import TrainBatch

        return TrainBatch.from_trajectories(
            trajs,
            self.processor,
            group_size=len(trajs),
            dedup=self.config.dedup,
            advantage=self.config.advantage,
        )

    # ------------------------------------------------------------------ iteration
    def _start_more(self, wanted: int) -> None:
        while len(self._pending) < wanted and not self._exhausted:
            try:
                task_index, row = next(self._rows)
            except StopIteration:
                self._exhausted = True
                break
            if task_index in self._skip:
                continue
            self.stats.prompts_started += 1
            task = asyncio.ensure_future(self._run_group(task_index, row, self.policy_version))
            self._task_index[task] = task_index
            self._task_env[task] = None if isinstance(row, Exception) else env_of_row(row)
            self._pending.append(task)

    @property
    def in_flight(self) -> int:
        """Groups started and not yet consumed."""
        return len(self._pending)

    def _staleness(self, group: GroupResult) -> int:
        """Versions between ``policy_version`` and the oldest turn of ``group`` (0 for an empty group)."""
        oldest: list[int] = []
        for traj in group.trajectories:
            version = _oldest_version(traj)
            oldest.append(group.started_version if version is None else version)
        return max((self.policy_version - v for v in oldest), default=0)

    def _drop_stale(self, group: GroupResult) -> None:
        """Record a group too old to train: each rollout as ``stale``, then the group (never silent)."""
        self.stats.groups_dropped_stale += 1
        k = self.config.max_staleness
        for traj in group.trajectories:
            version = _oldest_version(traj)
            oldest = group.started_version if version is None else version
            self.stats.count_ok(group.env, -1)
            if traj.mask_sample:
                self.stats.rollouts_masked -= 1
            self._rollout_failure(
                group.task_index,
                _rollout_of(traj),
                "stale",
                f"oldest policy version {oldest}, trainer at {self.policy_version}: "
                f"{self.policy_version - oldest} > max_staleness {k}",
                attempts=0,
                env=group.env,
            )
        logger.warning(
            "group of task %d dropped: %d policy versions old (max_staleness %d)",
            group.task_index,
            group.staleness,
            k,
        )
        self._record(
            {
                "kind": "group",
                "task_index": group.task_index,
                "succeeded": len(group.trajectories),
                "group_size": self.config.group_size,
                "failure_class": "stale",
                "failure_reason": (
                    f"{group.staleness} policy versions old when its batch was asked for "
                    f"(trainer at {self.policy_version}, max_staleness {k})"
                ),
                "rollout_failure_classes": {"stale": len(group.trajectories)},
                "dropped_rollouts": [_rollout_of(t) for t in group.trajectories],
                "staleness": group.staleness,
                "time": time.time(),
            },
            env=group.env,
        )

    def __aiter__(self) -> AsyncIterator[TrainBatch]:
        return self

    async def __anext__(self) -> TrainBatch:
        return (await self.next_batch()).batch

    async def next_batch(self, policy_version: int | None = None) -> BridgeBatch:
        """The next batch with what a training step reports about it (:class:`BridgeBatch`).

        ``policy_version``: the trainer's version now (staleness is measured from it); ``None``
        keeps the current :attr:`policy_version`. Raises ``StopAsyncIteration`` when the data
        ran out, :class:`BridgeStalledError` when too many groups failed in a row.
        """
        if policy_version is not None:
            self.policy_version = policy_version
        if self._closed:
            raise StopAsyncIteration
        asked = time.perf_counter()
        ok_before, failed_before = self.stats.rollouts_ok, self.stats.rollouts_failed
        env_ok_before = dict(self.stats.env_rollouts_ok)
        env_failed_before = dict(self.stats.env_rollouts_failed)
        groups: list[GroupResult] = []
        consumed: list[GroupResult] = []
        dropped_stale: list[GroupResult] = []
        dropped_zero_variance: list[GroupResult] = []
        per_batch = self.config.prompts_per_step
        zero_variance_budget = self.config.dynamic_sampling_max_rounds * per_batch
        ahead = self.config.max_staleness * per_batch
        while len(groups) < per_batch:
            try:
                self._start_more(per_batch - len(groups) + ahead)
            except BaseException as exc:  # the rows raised: what we hold is recorded, not lost
                self._abandon(groups, exc)
                raise
            if not self._pending:
                break
            task = self._pending.popleft()
            try:
                result = await task
            except BaseException as exc:  # cancelled, or the group's task raised: recorded, not lost
                self._record_stopped(task, self._task_index.get(task, -1), self._task_env.get(task))
                self._abandon(groups, exc)
                raise
            finally:
                self._task_index.pop(task, None)
                self._task_env.pop(task, None)
            consumed.append(result)
            self.done_task_indices.add(result.task_index)
            if result.batch is not None:
                result = replace(result, staleness=self._staleness(result))
                if result.staleness > self.config.max_staleness and self.config.drop_stale:
                    self._drop_stale(result)
                    dropped_stale.append(result)
                    continue
            if result.batch is None:
                self.stats.groups_failed += 1
                self._consecutive_failed += 1
                logger.warning(
                    "group of task %d failed: %s", result.task_index, result.failures[-1]["failure_reason"]
                )
                if self._consecutive_failed >= self.config.max_consecutive_failed_groups:
                    causes = self.failures[-4 * self.config.group_size :]  # before the records of stopping
                    for done in groups:  # completed but never yielded: recorded, not lost
                        self._drop_group(done, "bridge_stopped", "the iterator stalled before its batch")
                    await self.aclose()  # groups in flight: each rollout recorded as cancelled
                    raise BridgeStalledError(
                        f"{self._consecutive_failed} consecutive groups failed "
                        f"(max_consecutive_failed_groups={self.config.max_consecutive_failed_groups}); "
                        f"last: {result.failures[-1]['failure_reason']}; "
                        f"rollout failures by class: {self.stats.failure_classes}",
                        failures=causes,
                    )
                continue
            self._consecutive_failed = 0
            if self.config.dynamic_sampling and zero_variance(result):
                if len(dropped_zero_variance) < zero_variance_budget:
                    self._drop_zero_variance(result)
                    dropped_zero_variance.append(result)
                    continue  # the next pass of the loop starts a prompt in its place
                logger.warning(
                    "dynamic sampling: %d zero-variance group(s) dropped for this batch "
                    "(dynamic_sampling_max_rounds=%d); training the zero-variance group of task %d",
                    len(dropped_zero_variance),
                    self.config.dynamic_sampling_max_rounds,
                    result.task_index,
                )
            self.stats.groups_completed += 1
            if len(result.trajectories) < self.config.group_size:
                self.stats.groups_partial += 1
            if zero_variance(result):
                self.stats.groups_zero_variance += 1
            groups.append(result)
        if not groups or (self.config.drop_last and len(groups) < per_batch):
            for dropped in groups:
                self._drop_group(dropped)  # before aclose: the record goes to the failures file
            await self.aclose()
            s = self.stats
            trained_or_dropped = s.groups_completed + s.groups_dropped + s.groups_zero_variance_dropped
            if trained_or_dropped == 0 and self.stats.prompts_started:
                raise BridgeStalledError(
                    "the dataset ended without a single completed group "
                    f"({self.stats.groups_failed} failed); "
                    f"rollout failures by class: {self.stats.failure_classes}",
                    failures=self.failures[-4 * self.config.group_size :],
                )
            raise StopAsyncIteration
        assembling = time.perf_counter()
        try:
            batch, groups = self._assemble(groups)
            if self.meter is not None:
                self.meter.record("rollout_to_policy", batch)
        except BaseException as exc:  # the groups are done (consumed) but never yielded: recorded
            self._abandon(groups, exc)
            raise
        finished = time.perf_counter()
        timings = BatchTimings(
            wait_s=finished - asked,
            rollouts_s=sum(g.rollouts_s for g in consumed),
            postprocess_s=sum(g.postprocess_s for g in consumed),
            build_s=sum(g.build_s for g in consumed),
            assemble_s=finished - assembling,
            groups=len(consumed),
            rollouts=sum(len(g.trajectories) for g in consumed),
        )
        self.stats.batches += 1
        return BridgeBatch(
            batch=batch,
            groups=groups,
            dropped_stale=dropped_stale,
            dropped_zero_variance=dropped_zero_variance,
            rollouts_ok=self.stats.rollouts_ok - ok_before,
            rollouts_failed=self.stats.rollouts_failed - failed_before,
            timings=timings,
            env_rollouts_ok=_delta(self.stats.env_rollouts_ok, env_ok_before, self.stats.env_rollouts_failed),
            env_rollouts_failed=_delta(
                self.stats.env_rollouts_failed, env_failed_before, self.stats.env_rollouts_ok
            ),
        )

    def _drop_zero_variance(self, group: GroupResult) -> None:
        """Record a zero-variance group dynamic sampling leaves out (its rollouts listed, never silent)."""
        self.stats.groups_zero_variance_dropped += 1
        self.stats.rollouts_dropped += len(group.trajectories)
        rewards = sorted({t.reward for t in group.trajectories if not t.mask_sample})
        self._record(
            {
                "kind": "group",
                "task_index": group.task_index,
                "succeeded": len(group.trajectories),
                "group_size": self.config.group_size,
                "failure_class": "zero_variance",
                "failure_reason": (
                    f"every trainable reward is {rewards[0] if rewards else None}: zero advantages, no "
                    "learning signal (dynamic_sampling: another prompt was drawn in its place)"
                ),
                "rewards": [t.reward for t in group.trajectories],
                "rollout_failure_classes": {},
                "dropped_rollouts": [_rollout_of(t) for t in group.trajectories],
                "time": time.time(),
            },
            env=group.env,
        )

    def _drop_group(
        self,
        group: GroupResult,
        failure_class: str = "drop_last",
        reason: str | None = None,
        *,
        counted: bool = True,
    ) -> None:
        """Record a completed group that is never yielded (``drop_last``, or the iterator stopping).

        ``counted``: the group is already in ``groups_completed`` (popped by ``__anext__``).
        """
        if counted:
            self.stats.groups_completed -= 1
        self.stats.groups_dropped += 1
        self.stats.rollouts_dropped += len(group.trajectories)
        if reason is None:
            reason = (
                f"final partial batch ({self.config.prompts_per_step} groups per batch) dropped by drop_last"
            )
        logger.warning("%s: discarding the completed group of task %d", failure_class, group.task_index)
        self._record(
            {
                "kind": "group",
                "task_index": group.task_index,
                "succeeded": len(group.trajectories),
                "group_size": self.config.group_size,
                "failure_class": failure_class,
                "failure_reason": reason,
                "rollout_failure_classes": {},
                "dropped_rollouts": [_rollout_of(t) for t in group.trajectories],
                "time": time.time(),
            },
            env=group.env,
        )

    def _abandon(self, groups: list[GroupResult], exc: BaseException) -> None:
        """Record the completed groups of a batch that ``exc`` stops before it is yielded."""
        if isinstance(exc, asyncio.CancelledError):
            reason = "the iterator was cancelled before its batch"
        else:
            reason = f"the iterator stopped before its batch: {type(exc).__name__}: {exc}"
        for done in groups:
            self._drop_group(done, "bridge_stopped", reason)

    def _record_stopped(
        self, task: asyncio.Task[GroupResult], task_index: int, env: str | None = None
    ) -> None:
        """The records of a prompt still pending when the iterator stops: every started rollout ends
        in a batch or a record. A group that finished meanwhile keeps its own outcome; each rollout
        of a group cancelled in flight is a rollout record of class ``cancelled`` (of the exception's
        class when the group's task raised), then the group is a ``bridge_stopped`` record."""
        if task.done() and not task.cancelled() and task.exception() is None:
            result = task.result()
            if result.batch is None:
                self.stats.groups_failed += 1  # its group record was written by _run_group
            else:
                self._drop_group(
                    result, "bridge_stopped", "the iterator stopped before its batch", counted=False
                )
            return
        self.stats.groups_dropped += 1
        error = None if task.cancelled() or not task.done() else task.exception()
        if error is None:
            cls, reason = "cancelled", "cancelled in flight: the iterator stopped before the group finished"
        else:
            cls, reason = type(error).__name__, f"the group's task raised {type(error).__name__}: {error}"
        for rollout_index in range(self.config.group_size):
            self._rollout_failure(
                task_index, rollout_index, cls, reason, attempts=0, cancelled=error is None, env=env
            )
        self._record(
            {
                "kind": "group",
                "task_index": task_index,
                "succeeded": 0,
                "group_size": self.config.group_size,
                "failure_class": "bridge_stopped",
                "failure_reason": reason,
                "rollout_failure_classes": {cls: self.config.group_size},
                "dropped_rollouts": [],
                "time": time.time(),
            },
            env=env,
        )

    def _assemble(self, groups: list[GroupResult]) -> tuple[TrainBatch, list[GroupResult]]:
        """The step's batch, and ``groups`` with batches carrying the advantages it trains on."""
        from gymbridge.tensors import TrainBatch

        # each group's batch has group ids 0 and sample ids 0..n-1 (``_build``): renumbering
        # gives group k the id k and keeps sample ids unique across groups
        batch = TrainBatch.cat([g.batch for g in groups if g.batch is not None], renumber=True)
        if self.config.advantage not in BATCH_ADVANTAGE_MODES:
            return batch, groups
        # each group's batch was built with its own rewards as the baseline; the mode's baseline
        # is the step's whole batch, and the groups' records show the advantages it trains on
        batch = batch.batch_advantages(self.config.advantage)
        out: list[GroupResult] = []
        row = 0
        for g in groups:
            if g.batch is not None:
                rows = len(g.batch)
                g = replace(g, batch=replace(g.batch, advantages=batch.advantages[row : row + rows].clone()))
                row += rows
            out.append(g)
        return batch, out

    def __iter__(self) -> Iterator[TrainBatch]:
        loop = asyncio.new_event_loop()
        try:
            while True:
                try:
                    yield loop.run_until_complete(self.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            loop.run_until_complete(self.aclose())
            loop.close()

    async def aclose(self) -> None:
        """Cancel rollouts still in flight and close the failures file (the source is the caller's)."""
        self._closed = True
        pending = list(self._pending)
        self._pending.clear()
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for task in pending:
            self._record_stopped(task, self._task_index.pop(task, -1), self._task_env.pop(task, None))
        if self._failures_file is not None:
            self._failures_file.close()
            self._failures_file = None
