"""The step split's arithmetic (gymbridge/run/timing.py): phases add up to the step, overlaps counted once."""

from __future__ import annotations

import asyncio

import pytest

from gymbridge.bridge import BatchTimings
from gymbridge.run.timing import PHASES, CounterSource, StepCounters, median_split, split_step


def _split(**kw: object) -> dict[str, float]:
    args: dict[str, object] = {
        "step_s": 1.0,
        "batch_wait_s": 0.6,
        "batch": BatchTimings(wait_s=0.6, postprocess_s=0.05, build_s=0.04, assemble_s=0.01),
        "model": {"compute_busy_s": 0.3},
        "agent": {"env_seed_busy_s": 0.1, "env_verify_busy_s": 0.05},
        "forward_backward_s": 0.2,
        "optimizer_s": 0.05,
        "update_s": 0.27,
        "weight_sync_s": 0.03,
        "artifacts_s": 0.02,
        "checkpoint_s": 0.0,
    }
    args.update(kw)
    return split_step(**args)  # type: ignore[arg-type]


def test_the_phases_add_up_to_the_step() -> None:
    out = _split()
    assert list(out) == list(PHASES)
    assert out["postprocess"] == pytest.approx(0.05) and out["batch_build"] == pytest.approx(0.05)
    assert out["generation"] == pytest.approx(0.3) and out["env_seed"] == pytest.approx(0.1)
    assert out["env_verify"] == pytest.approx(0.05)
    assert out["wait_rollouts"] == pytest.approx(0.6 - 0.1 - 0.3 - 0.15)
    assert out["other"] == pytest.approx(1.0 - 0.6 - 0.27 - 0.03 - 0.02 + 0.02)  # update's rest is other


def test_overlapping_busy_seconds_never_exceed_the_wait() -> None:
    """Concurrent rollouts: the model's and the env's busy seconds overlap; the wait is not exceeded."""
    out = _split(model={"compute_busy_s": 0.5}, agent={"env_seed_busy_s": 0.4, "env_tool_busy_s": 0.3})
    inside = ("wait_rollouts", "generation", "env_seed", "env_tool", "postprocess", "batch_build")
    assert sum(out[p] for p in inside) == pytest.approx(0.6)
    assert out["wait_rollouts"] == 0.0 and out["env_tool"] == 0.0 and out["env_seed"] == pytest.approx(0.0)
    assert out["other"] == pytest.approx(1.0 - 0.6 - 0.25 - 0.03 - 0.02)


def test_phases_measured_past_the_step_show_as_a_negative_other() -> None:
    """``other`` is never clamped: phases that overlap (counted twice) show instead of hiding."""
    out = _split(step_s=0.5)
    assert out["other"] == pytest.approx(0.5 - 0.6 - 0.25 - 0.03 - 0.02)


def test_without_counters_the_wait_is_all_waiting() -> None:
    out = _split(batch=None, model={}, agent={})
    assert out["wait_rollouts"] == pytest.approx(0.6) and out["generation"] == 0.0


def test_a_source_that_cannot_answer_is_switched_off_not_fatal() -> None:
    calls = []

    def broken() -> dict[str, float]:
        calls.append(1)
        raise RuntimeError("gone")

    counters = StepCounters(CounterSource("model server", local=broken), None)

    async def go() -> tuple[dict[str, float], dict[str, float]]:
        await counters.start()
        return await counters.delta()

    assert asyncio.run(go()) == ({}, {}) and calls == [1]


def test_the_median_line_names_the_phases_that_took_time() -> None:
    records = [
        {"step": i, "step_s": s, **{f"timing/{k}": v for k, v in _split(step_s=s).items()}}
        for i, s in enumerate([1.0, 2.0, 3.0], 1)
    ]
    line = median_split(records)
    assert line.startswith("step time, median of 3 step(s): 2.000s; per phase (s): wait_rollouts 0.050")
    assert "checkpoint" not in line and "generation 0.300" in line
