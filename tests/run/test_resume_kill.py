"""``kill -9`` a run at different moments, resume it, and check what the run directory says.

After the resumed run: ``metrics.jsonl`` holds steps ``1..N`` once each, no dataset row was
trained twice, and every row was trained or has a group record in ``failures.jsonl``. A run killed
before its first checkpoint is refused by ``--resume`` and started afresh by ``--resume-or-start``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

# a hang guard: each case took 160-740 s on a 2-core machine at load average 10-25
pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

# steps enough that every kill point leaves several to run: a loaded machine's poller may notice a
# kill point late, and the run must still be going when the SIGKILL lands
STEPS = 8
BASE = [
    "--native",
    "--steps",
    str(STEPS),
    "--prompts",
    "1",
    "--group-size",
    "2",
    "--no-progress",
    "--set",
    "rollout.max_tokens=4",
    "--set",
    "warmup.steps=4",
    "--set",
    "output.payload_metrics=false",
    "--set",
    "checkpoint.every=1",
]


def smoke(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-u", "-m", "gymbridge.cli", "smoke", "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def wait_until(proc: subprocess.Popen[bytes], ready: Callable[[], bool], timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, (
            f"the run ended before the kill point: {proc.stdout and proc.stdout.read()!r}"
        )
        # wallclock-ok: a hang guard (a loaded 2-core machine reaches a kill point in ~100 s)
        assert time.monotonic() < deadline, "kill point never reached"
        time.sleep(0.01)


def lines(path: Path) -> list[dict[str, object]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


def checkpointed(run: Path, step: int) -> Callable[[], bool]:
    def ready() -> bool:
        latest = run / "checkpoints" / "latest.json"
        try:
            return int(orjson.loads(latest.read_bytes())["step"]) >= step
        except (FileNotFoundError, orjson.JSONDecodeError):
            return False

    return ready


MOMENTS: dict[str, tuple[list[str], Callable[[Path], Callable[[], bool]], float]] = {
    # before any checkpoint: the first step's metrics line is written; the first checkpoint is step
    # 2's (a whole step later), so the kill always lands before it and the refusal path always runs
    "before_first_checkpoint": (
        ["--set", "checkpoint.every=2"],
        lambda run: lambda: bool(lines(run / "metrics.jsonl")),
        0.0,
    ),
    "right_after_first_checkpoint": ([], lambda run: checkpointed(run, 1), 0.0),
    # running ahead: the next batch's rollouts are in flight, step 3 is under way
    "mid_step_running_ahead": (["--set", "bridge.max_staleness=1"], lambda run: checkpointed(run, 2), 0.02),
}


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_sigkill_then_resume_trains_each_row_once(moment: str, tmp_path: Path) -> None:
    extra, kill_point, delay_s = MOMENTS[moment]
    run = tmp_path / "run"
    proc = smoke(*BASE, *extra, "--run-dir", str(run))
    try:
        wait_until(proc, kill_point(run))
        time.sleep(delay_s)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    killed_steps = [r["step"] for r in lines(run / "metrics.jsonl")]
    assert killed_steps != list(range(1, STEPS + 1)), "the run finished before it was killed"

    fresh = moment == "before_first_checkpoint"
    assert (run / "checkpoints" / "latest.json").exists() != fresh, killed_steps

    resumed = smoke("--resume", str(run))
    out, _ = resumed.communicate(timeout=600)
    text = out.decode()
    if fresh:  # refused, then started again with the earlier attempt's lines set aside
        assert resumed.returncode == 2 and "no checkpoint in" in text, text
        resumed = smoke("--resume-or-start", str(run))
        out, _ = resumed.communicate(timeout=600)
        text = out.decode()
        assert "starting afresh" in text and "format warm-up" in text, text
    else:
        assert "resumed: " in text
    assert resumed.returncode == 0, text

    metrics = lines(run / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1)), text
    trained = [t for r in metrics for t in r["task_indices"]]  # type: ignore[attr-defined]
    assert len(trained) == len(set(trained)), trained  # no row trained twice
    failures = lines(run / "failures.jsonl")
    recorded = {f["task_index"] for f in failures if f["kind"] == "group"}
    assert set(trained) | recorded == set(range(STEPS)), (trained, failures)  # none skipped unrecorded
    assert not set(trained) & recorded
