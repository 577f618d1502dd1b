"""Callbacks: what a run does with each :class:`~gymbridge.run.report.StepReport`.

A :class:`Callback` gets the run once it is set up (:meth:`~Callback.on_setup`), every message
the run says (:meth:`~Callback.on_message`: set-up lines, the end summary), every step's report
and ``metrics.jsonl`` record (:meth:`~Callback.on_step`) and the :class:`RunSummary` at the end.
:func:`default_callbacks` are what ``gymbridge train`` uses, in this order: the metrics file
(the step's line is on disk before anything else happens), the run artifacts (charts, rollouts,
viewer), the W&B / TensorBoard reporters, the console.

Invariant: callbacks read the report and the record, never the bridge's or the trainer's state;
a callback's ``on_step`` runs off the event loop (in a worker thread), so rollouts in flight keep
going while it runs; the step waits for it (its seconds are the next step's ``timing/artifacts``),
so :class:`ArtifactsCallback` hands its writing to a thread of its own and returns.
"""

from __future__ import annotations

import collections
import logging
import sys
from collections.abc import Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gymbridge.run.config import RunConfig
    from gymbridge.run.recipe import GRPORun
    from gymbridge.run.report import RunSummary, StepReport

logger = logging.getLogger(__name__)

__all__ = [
    "ArtifactsCallback",
    "Callback",
    "ConsoleCallback",
    "MetricsFileCallback",
    "ReportersCallback",
    "default_callbacks",
    "step_line",
]


class Callback:
    """A run's observer; every hook is optional (the base does nothing)."""

    def on_setup(self, run: GRPORun) -> None:
        """The run is set up: its config, run directory and model are there; no step has run."""

    def on_message(self, text: str) -> None:
        """One line the run says (set-up, warnings a user must see, the end summary)."""

    def on_step(self, report: StepReport, record: Mapping[str, Any]) -> None:
        """A step is done; ``record`` is its ``metrics.jsonl`` line."""

    def on_eval(self, record: Mapping[str, Any], rollouts: Sequence[Mapping[str, Any]]) -> None:
        """A validation pass is done (:mod:`gymbridge.run.evaluation`): ``record`` is its ``eval.jsonl``
        line, ``rollouts`` the lines of its ``eval/step_<n>.jsonl`` (already written)."""

    def on_end(self, summary: RunSummary) -> None:
        """The run's last step is done (or the data ran out); nothing more will be trained."""

    def close(self) -> None:
        """Release what the callback holds (called once, on success, error or interrupt)."""


class MetricsFileCallback(Callback):
    """Appends each step's record to ``<run_dir>/metrics.jsonl`` (one synced line per step)."""

    def on_setup(self, run: GRPORun) -> None:
        self._run_dir = run.run_dir

    def on_step(self, report: StepReport, record: Mapping[str, Any]) -> None:
        self._run_dir.append_metrics(record)


class ArtifactsCallback(Callback):
    """``rollouts/step_<n>.jsonl`` and the step's viewer file every step, ``charts/`` and the
    viewer's index at step 1, every ``chart_every`` steps and at the end; each validation pass's
    viewer file, its line in the viewer's Validation list and its points on the charts
    (:mod:`gymbridge.run.artifacts`).

    A writer thread of its own does the writing: ``on_step`` queues the step and its record and
    returns, so the loop goes on while the files are written, in step order; ``on_eval`` queues a
    pass the same way, in turn with the steps. A refresh of the charts and viewer that falls due
    while the previous one is still queued or running is skipped (the next one, or the end, draws
    every step); so is a pass's redraw of its two charts while the previous pass's is queued. At
    most :attr:`backlog` steps or passes wait for the writer: beyond that ``on_step`` (``on_eval``)
    waits (visibly, in the next step's ``timing/artifacts``). A writer's error is raised at the
    next ``on_step`` / ``on_eval`` or at the end; when the run stops on an error of its own,
    :meth:`close` waits for the queued writes and says (and logs) each one's error instead. It
    holds no step's record beyond the queued ones: the charts' values are compact series
    (:class:`~gymbridge.run.artifacts.ChartSeries`, :class:`~gymbridge.run.artifacts.EvalSeries`),
    which a resumed run reads from ``metrics.jsonl`` and ``eval.jsonl`` a line at a time, in the
    writer thread (the set-up does not wait for it).
    """

    backlog = 4

    def on_setup(self, run: GRPORun) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from gymbridge.run.artifacts import RunArtifacts

        self._say = run.say
        self._artifacts = RunArtifacts(
            run.run_dir.path,
            decode=run.model.tokenizer.decode,
            chart_every=run.config.output.chart_every,
        )
        self._writer: Any = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gymbridge-artifacts")
        self._queued: collections.deque[tuple[str, Any]] = collections.deque()  # (what, its write)
        self._refresh: Any = None
        self._eval_refresh: Any = None
        # a resumed run's earlier steps and passes: read by the writer, before its first step's
        # files, so the set-up does not wait for a read that grows with the run's length
        job = self._writer.submit(self._load_series, run.run_dir)
        self._queued.append(("the chart history", job))

    def _load_series(self, run_dir: Any) -> None:
        from gymbridge.run.artifacts import ChartSeries, EvalSeries

        self._artifacts.series = ChartSeries.from_records(run_dir.iter_metrics())
        self._artifacts.eval_series = EvalSeries.from_records(run_dir.iter_eval())

    def _settle(self, keep: int) -> None:
        """Raise a finished write's error; wait until at most ``keep`` writes are queued."""
        while self._queued and (self._queued[0][1].done() or len(self._queued) > keep):
            self._queued.popleft()[1].result()

    def on_step(self, report: StepReport, record: Mapping[str, Any]) -> None:
        self._settle(self.backlog - 1)
        refresh = self._artifacts.refresh_due(report.step) and (self._refresh is None or self._refresh.done())
        job = self._writer.submit(
            self._artifacts.record_step,
            report.step,
            report.batch.groups,
            dict(record),  # the writer reads it later: a copy of this step's record only
            refresh=refresh,
        )
        self._queued.append((f"step {report.step}", job))
        if refresh:
            self._refresh = job

    def on_eval(self, record: Mapping[str, Any], rollouts: Sequence[Mapping[str, Any]]) -> None:
        self._settle(self.backlog - 1)
        refresh = self._eval_refresh is None or self._eval_refresh.done()
        job = self._writer.submit(
            self._artifacts.record_eval,
            dict(record),  # copies: the writer reads them later
            [dict(r) for r in rollouts],
            refresh=refresh,
        )
        self._queued.append((f"the validation pass after step {record.get('step')}", job))
        if refresh:
            self._eval_refresh = job

    def on_end(self, summary: RunSummary) -> None:
        self._settle(0)
        self._artifacts.finish()
        self._say(f"charts: {self._artifacts.charts_path}/\nviewer: {self._artifacts.viewer_path}")

    def close(self) -> None:
        writer = getattr(self, "_writer", None)
        if writer is not None:
            writer.shutdown(wait=True)  # every file is written whole (atomically) or not at all
            self._writer = None
            # an error path (the run's own error is on its way): raising here would hide it
            while self._queued:
                what, job = self._queued.popleft()
                error = job.exception()
                if error is not None:
                    logger.error("the artifacts of %s were not written", what, exc_info=error)
                    self._say(f"artifacts of {what} not written: {type(error).__name__}: {error}")


class ReportersCallback(Callback):
    """Sends each record to W&B / TensorBoard (``output.report_to``; optional extras)."""

    def __init__(self) -> None:
        self._reporters: list[Any] = []

    def on_setup(self, run: GRPORun) -> None:
        from gymbridge.run.reporters import open_reporters

        names = run.config.output.report_to
        self._reporters = open_reporters(names, run.run_dir.path, run.config.model_dump(mode="json"))

    def on_step(self, report: StepReport, record: Mapping[str, Any]) -> None:
        for reporter in self._reporters:
            reporter.log(report.step, record)

    def close(self) -> None:
        for reporter in self._reporters:
            reporter.close()
        self._reporters = []


class ConsoleCallback(Callback):
    """Prints the run's messages and one line per step (a progress bar when ``progress``)."""

    def __init__(self, out: IO[str] | None = None, *, progress: bool = False) -> None:
        self.out = out if out is not None else sys.stdout
        self.progress = progress
        self._bar: Any = None
        self._config: RunConfig | None = None

    def on_setup(self, run: GRPORun) -> None:
        from tqdm.auto import tqdm

        self._config = run.config
        self._bar = tqdm(
            total=run.config.steps,
            initial=run.first_step - 1,
            desc="train",
            unit="step",
            disable=not self.progress,
        )

    def on_message(self, text: str) -> None:
        if self._bar is not None:
            self._bar.clear()
        print(text, file=self.out, flush=True)

    def on_step(self, report: StepReport, record: Mapping[str, Any]) -> None:
        assert self._config is not None
        if self._bar is not None:
            self._bar.update(1)
            self._bar.clear()
        print(step_line(report, record, self._config), file=self.out, flush=True)

    def on_end(self, summary: RunSummary) -> None:
        self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def default_callbacks(
    *, out: IO[str] | None = None, progress: bool = False, artifacts: bool = True
) -> list[Callback]:
    """What ``gymbridge train`` reports with (module docstring); ``artifacts=False``
    (``output.artifacts: false``) leaves out rollouts, charts and viewer."""
    return [
        MetricsFileCallback(),
        *([ArtifactsCallback()] if artifacts else []),
        ReportersCallback(),
        ConsoleCallback(out, progress=progress),
    ]


def step_line(report: StepReport, record: Mapping[str, Any], config: RunConfig) -> str:
    """The console's line for a step: rewards, loss, tokens, gradient, ratios, rollouts, what is on."""
    m = report.metrics
    rewards = f"env reward {report.env_reward_mean:.3f}"
    if report.shaped:
        rewards += f"  shaped reward {report.env_reward_mean + report.shaping_reward_mean:.3f}"
    loss = m.loss if abs(m.loss) >= 5e-6 else 0.0  # no "-0.00000" vs "+0.00000" flicker between reruns
    line = (
        f"step {report.step}/{report.total_steps}  {rewards}  loss {loss:+.5f}  tokens {m.num_tokens} "
        f"(trained {m.num_loss_tokens})  grad_norm {m.grad_norm:.4f}  ratio {m.mean_ratio:.4f}  "
        f"ratio_mean {m.ratio_mean:.5f}  rollouts {report.batch.rollouts_ok} ok / "
        f"{report.batch.rollouts_failed} failed  {m.elapsed_s:.2f}s train"
    )
    if report.skipped is not None:
        line += f"  skipped ({report.skipped.replace('_', ' ')}: no update, v{report.policy_version} kept)"
    elif report.published:
        line += f"  -> v{report.policy_version} (sync {report.weight_sync_s:.3f}s)"
    elif not config.generator.publish_weights:
        line += " (not published: generator.publish_weights is off)"
    if record.get("dp_strategy"):  # each rank's parameters, gradients and optimizer state: the largest
        held = max((sum(b.values()) for b in record.get("dp_rank_state_bytes") or []), default=0)
        line += f"  dp {record['dp_strategy']} x{record['dp_world_size']} ({held / 2**20:.2f} MiB state/rank)"
    if config.bridge.max_staleness > 0:
        line += f"  staleness {record['staleness_max']} (dropped {record['groups_dropped_stale']})"
    if config.trainer.lr_scheduled and report.skipped is None:
        line += f"  lr {m.lr:.2e}"
    if config.trainer.kl_coef > 0:
        line += f"  kl {m.kl:.5f} ({config.trainer.kl_estimator})"
    if m.entropy is not None:
        line += f"  entropy {m.entropy:.3f}"
    if config.trainer.mask_truncated:
        line += f"  truncated masked {m.truncated_masked}"
    if config.bridge.dynamic_sampling:
        line += f"  zero-variance dropped {record['groups_zero_variance_dropped']}"
    truncated, ok = record.get("rollouts_truncated", 0), record.get("rollouts_ok", 0)
    if ok and 2 * truncated > ok:
        line += f"  TRUNCATED {truncated}/{ok} rollouts (a limit hit: rollout.max_tokens?)"
    for name, why in (record.get("counters_unavailable") or {}).items():
        line += f"  no {name} counters ({why}: in wait_rollouts)"
    return line + _env_summary(record) + _media_summary(report)


def _env_summary(record: Mapping[str, Any]) -> str:
    """``  envs color_pick 0.500 (4 ok / 0 failed), side_pick - (3 ok / 1 failed)``: the record's
    per-environment keys (``env/<name>/...``; ``-``: none of its groups trained this step)."""
    from gymbridge.run.report import ENV_KEY_PREFIX, env_key

    suffix = "/rollouts_ok"
    envs = [
        k[len(ENV_KEY_PREFIX) : -len(suffix)]
        for k in record
        if k.startswith(ENV_KEY_PREFIX) and k.endswith(suffix)
    ]
    if not envs:
        return ""
    parts = []
    for env in envs:
        reward = record.get(env_key(env, "reward_mean"))
        shown = "-" if reward is None else f"{reward:.3f}"
        parts.append(
            f"{env} {shown} ({record.get(env_key(env, 'rollouts_ok'), 0)} ok / "
            f"{record.get(env_key(env, 'rollouts_failed'), 0)} failed)"
        )
    return "  envs " + ", ".join(parts)


def _media_summary(report: StepReport) -> str:
    """``  media video: pixel_values_videos, video_grid_thw (2 unique)`` for the step's batch."""
    batch = report.batch.batch
    keys = batch.media_keys()
    if not keys:
        return ""
    unique = batch.media_content_keys()
    parts = [
        f"{modality}: {', '.join(names)} ({len(unique.get(modality, []))} unique)"
        for modality, names in sorted(keys.items())
    ]
    return "  media " + "; ".join(parts)
