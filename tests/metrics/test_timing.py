"""PhaseTimer: sums, busy time (the union of intervals), counts and counters, all monotone;
checked against a plain reference under a fake clock, and under real threads."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gymbridge.metrics import PhaseTimer, timing_delta
from gymbridge.metrics import timing as timing_module


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(timing_module.time, "perf_counter", fake)
    return fake


def test_concurrent_intervals_sum_but_busy_counts_their_union(clock: Clock) -> None:
    timer = PhaseTimer()
    a = timer.start("verify")
    clock.now = 1.0
    b = timer.start("verify")  # overlaps a for 1 s
    clock.now = 2.0
    assert timer.stop(a) == 2.0
    clock.now = 3.0
    timer.stop(b)
    clock.now = 10.0
    c = timer.start("verify")  # a later stretch, open at the snapshot
    clock.now = 10.5
    snap = timer.snapshot()
    assert snap == {"verify_s": 2.0 + 2.0 + 0.5, "verify_busy_s": 3.0 + 0.5, "verify_n": 2.0}
    timer.stop(c)
    assert timer.stop(c) == 0.0  # a closed token is a no-op


def test_add_and_count_and_delta(clock: Clock) -> None:
    timer = PhaseTimer()
    timer.add("weights_receive", 0.25)
    timer.count("generated_tokens", 7)
    before = timer.snapshot()
    timer.count("generated_tokens", 3)
    timer.add("weights_receive", 0.5)
    delta = timing_delta(timer.snapshot(), before)
    assert delta == {
        "weights_receive_s": 0.5,
        "weights_receive_busy_s": 0.5,
        "weights_receive_n": 1.0,
        "generated_tokens": 3.0,
    }
    with pytest.raises(ValueError, match="only grows"):
        timer.add("x", -1.0)
    with pytest.raises(ValueError, match="only grows"):
        timer.count("x", float("nan"))


def test_with_block_closes_the_interval_on_errors(clock: Clock) -> None:
    timer = PhaseTimer()

    def fail() -> None:
        with timer.time("env_seed"):
            clock.now = 0.75
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        fail()
    clock.now = 5.0
    assert timer.snapshot()["env_seed_s"] == 0.75


# an event: (phase 0-2, open=True / close=False, clock step)
events = st.lists(st.tuples(st.integers(0, 2), st.booleans(), st.floats(0, 3)), max_size=60)


@given(events)
def test_matches_a_reference_and_every_snapshot_only_grows(script: list[tuple[int, bool, float]]) -> None:
    fake = Clock()
    original = timing_module.time.perf_counter
    timing_module.time.perf_counter = fake  # type: ignore[assignment]
    try:
        timer = PhaseTimer()
        open_tokens: dict[int, list[tuple[int, float]]] = {0: [], 1: [], 2: []}
        closed: dict[int, list[tuple[float, float]]] = {0: [], 1: [], 2: []}
        last: dict[str, float] = {}
        for phase, opening, step in script:
            fake.now += step
            if opening or not open_tokens[phase]:
                open_tokens[phase].append((timer.start(f"p{phase}"), fake.now))
            else:
                token, began = open_tokens[phase].pop(0)
                timer.stop(token)
                closed[phase].append((began, fake.now))
            snap = timer.snapshot()
            assert all(snap[k] >= last.get(k, 0.0) - 1e-9 for k in snap)
            assert set(last) <= set(snap)
            last = snap
        for phase in range(3):
            spans = closed[phase] + [(began, fake.now) for _, began in open_tokens[phase]]
            if not spans:
                continue
            union = 0.0
            end = float("-inf")
            for lo, hi in sorted(spans):
                if hi > end:
                    union += hi - max(lo, end)
                    end = hi
            assert last[f"p{phase}_s"] == pytest.approx(sum(hi - lo for lo, hi in spans))
            assert last[f"p{phase}_busy_s"] == pytest.approx(union)
            assert last[f"p{phase}_n"] == len(closed[phase])
            assert last[f"p{phase}_busy_s"] <= last[f"p{phase}_s"] + 1e-9
    finally:
        timing_module.time.perf_counter = original  # type: ignore[assignment]


def test_threads_lose_no_interval() -> None:
    timer = PhaseTimer()

    def work() -> None:
        for _ in range(500):
            with timer.time("compute"):
                pass
            timer.count("rows")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    snap = timer.snapshot()
    assert snap["compute_n"] == 2000 and snap["rows"] == 2000
    assert 0.0 <= snap["compute_busy_s"] <= snap["compute_s"]
