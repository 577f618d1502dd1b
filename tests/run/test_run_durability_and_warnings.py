"""Issue 39: history that survives (fsync, appended logs, no overwritten data) and warnings a run
must say (most rollouts truncated, missing counters, artifact writes that failed on an error path)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gymbridge.bridge import BridgeBatch, GroupResult
from gymbridge.errors import ConfigError, GeneratorProcessError
from gymbridge.run import ArtifactsCallback, RunConfig, RunDir, RunSummary, StepReport
from gymbridge.run.callbacks import step_line
from gymbridge.run.collect import _check_paths, collect
from gymbridge.run.generator_process import start_model_server_process
from gymbridge.run.timing import CounterSource, StepCounters
from gymbridge.trainer.grpo import StepMetrics
from gymbridge.trajectory import Trajectory

CONFIG = RunConfig.model_validate({"steps": 2, "env": {"name": "in_process"}})


class _Batch:
    """The few ``TrainBatch`` methods a report reads (no media)."""

    def media_keys(self) -> dict[str, list[str]]:
        return {}

    def media_content_keys(self) -> dict[str, list[str]]:
        return {}


def report(
    step: int, *, truncated: int, ok: int = 4, unavailable: dict[str, str] | None = None
) -> StepReport:
    trajs = [Trajectory(turns=[], reward=0.0, truncated=i < truncated, rollout_index=i) for i in range(ok)]
    group = GroupResult(
        task_index=step, batch=None, trajectories=trajs, failures=[], rewards=[0.0] * ok, elapsed_s=0.0
    )
    metrics = StepMetrics(0.0, 0.0, 0.0, ok, 10, 4, 0.0, 0.0, 1.0, 0.0, skipped="zero_advantage")
    batch = BridgeBatch(_Batch(), [group], [], [], rollouts_ok=ok, rollouts_failed=0)  # type: ignore[arg-type]
    return StepReport(
        step=step,
        total_steps=2,
        metrics=metrics,
        batch=batch,
        policy_version=0,
        published=False,
        weight_sync_s=0.0,
        step_s=1.0,
        env_reward_mean=0.0,
        shaping_reward_mean=0.0,
        shaped=False,
        counters_unavailable=unavailable or {},
    )


def summary_of(*reports: StepReport) -> RunSummary:
    summary = RunSummary()
    for r in reports:
        summary.add(r, r.record())
    return summary


# ---------------------------------------------------------------------- item 2: truncation said


def test_regression_most_rollouts_truncated_is_said_on_the_step_line_and_at_the_end() -> None:
    """``rollout.max_tokens: 4`` truncated every tool call: every reward was 0 and every step was
    skipped, and nothing said why."""
    reports = [report(1, truncated=4), report(2, truncated=3)]
    record = reports[0].record()
    assert record["rollouts_truncated"] == 4 and record["rollouts_ok"] == 4
    assert "TRUNCATED 4/4 rollouts" in step_line(reports[0], record, CONFIG)
    (warning,) = summary_of(*reports).warnings()  # the end summary's lines (GRPORun._finish says them)
    assert warning.startswith("warning: 7 of 8 rollouts ended truncated (2 of 2 step(s) skipped)")
    assert "rollout.max_tokens" in warning


def test_a_few_truncated_rollouts_are_not_a_warning() -> None:
    calm = report(1, truncated=2)  # half: not most
    assert "TRUNCATED" not in step_line(calm, calm.record(), CONFIG)
    assert summary_of(calm).warnings() == []


# ---------------------------------------------------------------------- item 12: counters said


def test_regression_a_counter_source_that_stops_answering_is_said_on_the_step_line_and_at_the_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One failed ``/counters`` read turned the source off for the run, at INFO level; its time
    moved to ``wait_rollouts`` without a word on the step line or in the summary."""

    def gone() -> dict[str, float]:
        raise ConnectionError("agent gone")

    counters = StepCounters(CounterSource("model server", local=dict), CounterSource("agent", local=gone))

    async def two_steps() -> None:
        await counters.start()
        await counters.delta()

    with caplog.at_level("WARNING", logger="gymbridge.run.timing"):
        asyncio.run(two_steps())
    assert counters.unavailable == {"agent": "ConnectionError: agent gone"}
    assert "agent counters unavailable" in caplog.text
    step = report(3, truncated=0, unavailable=counters.unavailable)
    record = step.record()
    assert record["counters_unavailable"] == {"agent": "ConnectionError: agent gone"}
    assert "no agent counters (ConnectionError: agent gone: in wait_rollouts)" in step_line(
        step, record, CONFIG
    )
    warnings = summary_of(report(2, truncated=0), step).warnings()
    assert warnings == [
        "warning: no timing counters from the agent since step 3 (ConnectionError: agent gone): "
        "its phases are counted in timing/wait_rollouts"
    ]


# ---------------------------------------------------------------------- item 13: artifact errors


def test_regression_queued_artifact_writes_say_their_errors_when_the_run_stops(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On an error path ``close`` shut the writer down and dropped the queued writes' errors."""
    said: list[str] = []
    run = SimpleNamespace(
        say=said.append,
        run_dir=RunDir.create(tmp_path),
        model=SimpleNamespace(tokenizer=SimpleNamespace(decode=str)),
        config=SimpleNamespace(output=SimpleNamespace(chart_every=5)),
    )
    cb = ArtifactsCallback()
    cb.on_setup(run)  # type: ignore[arg-type]

    release = threading.Event()

    def broken(step: int, *args: Any, **kwargs: Any) -> None:
        release.wait(60)  # still queued when the run fails
        raise OSError(f"disk full at step {step}")

    cb._artifacts.record_step = broken  # type: ignore[method-assign]
    for step in (1, 2):
        cb.on_step(report(step, truncated=0), {"step": step})
    # the run fails elsewhere before on_end: only close runs
    release.set()
    with caplog.at_level("ERROR", logger="gymbridge.run.callbacks"):
        cb.close()
    assert said == [
        "artifacts of step 1 not written: OSError: disk full at step 1",
        "artifacts of step 2 not written: OSError: disk full at step 2",
    ]
    assert caplog.text.count("were not written") == 2


# ---------------------------------------------------------------------- item 9: fsync


def test_regression_metrics_and_failures_are_synced_before_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``metrics.jsonl`` and ``failures.jsonl`` were flushed, not fsynced, while the checkpoint that
    follows is: a power loss could keep a checkpointed step without its metrics line."""
    run = RunDir.create(tmp_path)
    with run.failures_path.open("ab") as bridge_file:  # the bridge's own handle, flushed per record
        bridge_file.write(b'{"kind": "rollout"}\n')
        bridge_file.flush()
        synced: list[tuple[int, int]] = []
        real = os.fsync

        def fsync(fd: int) -> None:
            st = os.fstat(fd)
            synced.append((st.st_dev, st.st_ino))
            real(fd)

        monkeypatch.setattr(os, "fsync", fsync)
        run.append_metrics({"step": 1})
    inode = {
        (st.st_dev, st.st_ino): p.name
        for p in (run.metrics_path, run.failures_path, tmp_path)
        for st in [p.stat()]
    }
    assert {inode[k] for k in synced} >= {"metrics.jsonl", "failures.jsonl"}
    assert run.metrics() == [{"step": 1}]


# ---------------------------------------------------------------------- item 10: the child's log


def fake_server(say: str, *, serve: bool = True) -> list[str]:
    ready = "print('serving on http://127.0.0.1:1', flush=True); import time; time.sleep(60)" if serve else ""
    return [
        sys.executable,
        "-c",
        f"import sys; sys.stderr.write({say!r} + '\\n'); sys.stderr.flush(); {ready}",
    ]


def test_regression_model_server_log_is_appended_not_truncated_on_restart(tmp_path: Path) -> None:
    """``model_server.log`` was opened with ``"w"``: a resumed run lost the earlier attempt's log."""
    log = tmp_path / "model_server.log"
    with start_model_server_process(fake_server("first attempt"), log_path=log, startup_timeout_s=60):
        pass
    with pytest.raises(GeneratorProcessError) as err:
        start_model_server_process(
            fake_server("second attempt", serve=False), log_path=log, startup_timeout_s=60
        )
    text = log.read_text()
    assert text.index("first attempt") < text.index("second attempt")
    assert text.count("--- model server start") == 2
    assert "second attempt" in str(err.value) and "first attempt" not in str(err.value)  # its own tail


# ---------------------------------------------------------------------- item 11: collect paths


def test_regression_collect_refuses_an_out_that_is_the_dataset(tmp_path: Path) -> None:
    """``--out X --dataset X`` emptied the dataset before reading it."""
    dataset = tmp_path / "rows.jsonl"
    dataset.write_bytes(b'{"responses_create_params": {"input": "hi"}}\n')
    before = dataset.read_bytes()
    with pytest.raises(ConfigError, match="is the dataset: writing it would empty it"):
        collect("http://127.0.0.1:9", dataset, tmp_path / "." / "rows.jsonl", progress=False)
    with pytest.raises(ConfigError, match=r"--failures .* is the dataset"):
        collect("http://127.0.0.1:9", dataset, tmp_path / "out.jsonl", failures=dataset, progress=False)
    assert dataset.read_bytes() == before


def test_regression_collect_refuses_to_overwrite_earlier_results(tmp_path: Path) -> None:
    """Earlier results at ``--out`` were overwritten without a word."""
    dataset = tmp_path / "rows.jsonl"
    dataset.write_bytes(b'{"responses_create_params": {"input": "hi"}}\n')
    out = tmp_path / "results.jsonl"
    out.write_bytes(b'{"reward": 1.0}\n')
    with pytest.raises(ConfigError, match=r"--out .*results.jsonl holds earlier results; pass --overwrite"):
        collect("http://127.0.0.1:9", dataset, out, progress=False)
    assert out.read_bytes() == b'{"reward": 1.0}\n'
    _check_paths(dataset, out, tmp_path / "results.failures.jsonl", None, overwrite=True)  # asked: allowed
    (tmp_path / "empty.jsonl").touch()
    _check_paths(dataset, tmp_path / "empty.jsonl", tmp_path / "empty.failures.jsonl", None, overwrite=False)
