"""Every started prompt ends in a batch or a failure record; any one rollout's exception is data."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest
from bridge_helpers import FakeAgent, make_rows

from gymbridge.bridge import BridgeConfig, BridgeIterator, BridgeStalledError, GymRollouts, RolloutRecord
from gymbridge.client import GymClient
from gymbridge.limits import MAX_JSON_DEPTH
from gymbridge.tensors import MediaProcessor
from gymbridge.testing.tiny_vlm import TinyVLM


def accounted(it: BridgeIterator, yielded: set[int]) -> None:
    """Every started prompt is in a yielded batch or has a group record; the counters agree."""
    s = it.stats
    assert s.prompts_started == s.groups_completed + s.groups_failed + s.groups_dropped
    recorded = {f["task_index"] for f in it.failures if f["kind"] == "group"}
    assert set(range(s.prompts_started)) == yielded | recorded
    assert not yielded & recorded


def deep(levels: int) -> Any:
    value: Any = 0
    for _ in range(levels):
        value = [value]
    return value


async def test_regression_bridge_stalled_error_records_completed_and_in_flight_groups(
    tiny: TinyVLM, processor: MediaProcessor
) -> None:
    """``BridgeStalledError`` cancelled the in-flight groups and the completed ones of the unfinished
    batch without any record."""

    def behaviour(task: int, rollout: int) -> float | int:
        return 1.0 if task == 0 else 422  # task 0 completes, every later prompt fails

    agent = FakeAgent(tiny, behaviour)
    client = GymClient("http://agent.test", transport=agent.transport())
    it = BridgeIterator(
        make_rows(12),
        GymRollouts(client),
        processor,
        BridgeConfig(group_size=2, prompts_per_step=4, max_consecutive_failed_groups=2, min_group_size=None),
    )
    with pytest.raises(BridgeStalledError):
        await it.__anext__()
    accounted(it, yielded=set())
    stopped = [f for f in it.failures if f["failure_class"] == "bridge_stopped"]
    assert {f["task_index"] for f in stopped} >= {0}  # the completed group that never became a batch
    assert stopped[0]["dropped_rollouts"] == [0, 1]
    await client.aclose()


class SlowSource:
    """Group ``task`` takes ``task * 0.05`` s; nothing fails."""

    def __init__(self, tiny: TinyVLM) -> None:
        self.agent = FakeAgent(tiny, lambda t, r: float(r))
        self.client = GymClient("http://agent.test", transport=self.agent.transport())
        self.inner = GymRollouts(self.client)

    async def rollouts(
        self, row: Mapping[str, Any], *, task_index: int, group_size: int
    ) -> list[RolloutRecord]:
        await asyncio.sleep(0.05 * task_index)
        return await self.inner.rollouts(row, task_index=task_index, group_size=group_size)

    async def aclose(self) -> None:
        await self.client.aclose()


async def test_closing_the_iterator_records_the_groups_still_in_flight(
    tiny: TinyVLM, processor: MediaProcessor
) -> None:
    source = SlowSource(tiny)
    it = BridgeIterator(
        make_rows(6),
        source,
        processor,
        BridgeConfig(group_size=2, prompts_per_step=3, min_group_size=None, max_consecutive_failed_groups=8),
    )
    await it.__anext__()
    it._start_more(3)  # as an async loop would: the next batch's prompts already running
    await asyncio.sleep(0)
    await it.aclose()
    accounted(it, yielded={0, 1, 2})
    assert {f["task_index"] for f in it.failures if f["failure_class"] == "bridge_stopped"} == {3, 4, 5}
    await source.aclose()


class RaisingSource:
    """A source whose prompt ``bad`` raises a plain ``TypeError`` (a bug, not a gymbridge error)."""

    def __init__(self, tiny: TinyVLM, bad: int) -> None:
        self.ok = SlowSource(tiny)
        self.bad = bad

    async def rollouts(
        self, row: Mapping[str, Any], *, task_index: int, group_size: int
    ) -> list[RolloutRecord]:
        if task_index == self.bad:
            raise TypeError("Recursion limit reached")
        return await self.ok.inner.rollouts(row, task_index=task_index, group_size=group_size)

    async def aclose(self) -> None:
        await self.ok.aclose()


async def test_regression_any_exception_of_a_source_is_recorded_not_raised(
    tiny: TinyVLM, processor: MediaProcessor
) -> None:
    """The iterator caught only gymbridge errors: one such prompt killed the whole run."""
    source = RaisingSource(tiny, bad=1)
    it = BridgeIterator(
        make_rows(3),
        source,
        processor,
        BridgeConfig(group_size=2, prompts_per_step=1, min_group_size=None, max_consecutive_failed_groups=8),
    )
    batches = [b async for b in it]
    assert len(batches) == 2 and it.stats.failure_classes == {"TypeError": 2}
    accounted(it, yielded={0, 2})
    await source.aclose()


async def test_regression_a_postprocessing_crash_is_that_rollouts_failure(
    tiny: TinyVLM, processor: MediaProcessor, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gymbridge.trajectory as trajectory

    real = trajectory.from_gym_result

    def flaky(result: dict[str, Any], **kw: Any) -> Any:
        if result["_ng_rollout_index"] == 1:
            raise RecursionError("maximum recursion depth exceeded")
        return real(result, **kw)

    monkeypatch.setattr(trajectory, "from_gym_result", flaky)
    agent = FakeAgent(tiny, lambda t, r: float(r))
    client = GymClient("http://agent.test", transport=agent.transport())
    it = BridgeIterator(
        make_rows(2),
        GymRollouts(client),
        processor,
        BridgeConfig(group_size=3, min_group_size=2, prompts_per_step=1, max_consecutive_failed_groups=8),
    )
    batches = [b async for b in it]
    assert [len(b) for b in batches] == [2, 2]
    assert it.stats.failure_classes == {"RecursionError": 2}
    await client.aclose()


async def test_regression_a_row_nested_too_deep_is_one_failed_prompt(
    tiny: TinyVLM, processor: MediaProcessor
) -> None:
    """A row nested 255-1024 levels deep made ``GymClient.run`` raise ``TypeError`` and killed
    the iterator; now it is a data failure of that prompt and the others train."""
    rows = make_rows(3)
    rows[1] = {**rows[1], "extra": deep(600)}
    agent = FakeAgent(tiny, lambda t, r: float(r))
    client = GymClient("http://agent.test", transport=agent.transport())
    it = BridgeIterator(
        rows,
        GymRollouts(client),
        processor,
        BridgeConfig(group_size=2, prompts_per_step=1, min_group_size=None, max_consecutive_failed_groups=8),
    )
    batches = [b async for b in it]
    assert len(batches) == 2 and it.stats.failure_classes == {"gym_data": 2}
    reasons = {f["failure_reason"] for f in it.failures if f["kind"] == "rollout"}
    assert reasons == {f"row nests arrays/objects deeper than {MAX_JSON_DEPTH} levels"}
    assert len(agent.seen) == 4  # the deep row was never sent
    await client.aclose()
