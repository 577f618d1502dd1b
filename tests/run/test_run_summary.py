"""RunSummary: what the end of a run prints, from memory that does not grow with the run."""

from __future__ import annotations

import sys
from types import SimpleNamespace

from gymbridge.run.report import RunSummary
from gymbridge.run.timing import median_split


def _report(step: int) -> SimpleNamespace:
    batch = SimpleNamespace(batch=SimpleNamespace(media_keys=lambda: {"image": [f"k{step}"]}))
    return SimpleNamespace(
        metrics=SimpleNamespace(step=step), env_reward_mean=step / 10, shaping_reward_mean=0.0, batch=batch
    )


def _record(step: int) -> dict:
    return {
        "step": step,
        "step_s": 1.0 + step % 3,
        "timing/other": 0.5,
        "timing/update": float(step % 2),
        "rollouts_ok": 4,
        "rollouts_truncated": 3,
        "skipped": "no_signal" if step % 5 == 0 else None,
        **({"counters_unavailable": {"environment": "404"}} if step >= 7 else {}),
        "pad": "x" * 2000,  # a record's size: what a window would hold 10,000 of
    }


def test_a_long_run_keeps_a_window_of_records_and_counts_the_rest() -> None:
    s = RunSummary()
    records = [_record(i) for i in range(1, 5001)]
    for i, rec in enumerate(records, 1):
        s.add(_report(i), rec)  # type: ignore[arg-type]
    assert len(s.records) == len(s.steps) == len(s.media_keys) == RunSummary.window
    assert s.records[-1]["step"] == 5000 and s.steps[0].step == 5000 - RunSummary.window + 1
    assert s.steps_done == 5000 and s.steps_skipped == 1000 and len(s.env_rewards) == 5000
    # the end lines are those of every step, not of the window
    assert median_split(s.step_seconds) == median_split(records)
    assert "median of 5000 step(s)" in median_split(s.step_seconds)
    warnings = s.warnings()
    assert "15000 of 20000 rollouts ended truncated (1000 of 5000 step(s) skipped)" in warnings[0]
    assert "no timing counters from the environment since step 7 (404)" in warnings[1]
    # a float a step per timing column, not a record a step
    held = sum(sys.getsizeof(col) for col in s.step_seconds.values())
    assert held < 5000 * 8 * len(s.step_seconds) + 4096
