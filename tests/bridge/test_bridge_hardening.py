"""Every started prompt ends in a batch or a failure record; any one rollout's exception is data."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from bridge_helpers import FakeAgent, make_rows

from gymbridge.bridge import BridgeConfig, BridgeIterator, BridgeStalledError, GymRollouts, RolloutRecord
from gymbridge.client import GymClient
from gymbridge.limits import MAX_JSON_DEPTH
from gymbridge.models.tiny_vlm import TinyVLM
from gymbridge.tensors import MediaProcessor


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


class LoopbackAgent:
    """``FakeAgent``'s answers served over HTTP on 127.0.0.1; a rollout of a task in ``hang`` never
    answers (until its request is cancelled). ``hanging`` counts the requests still held."""

    def __init__(self, tiny: TinyVLM, behaviour: Any, hang: set[int]) -> None:
        self.fake = FakeAgent(tiny, behaviour)
        self.hang = hang
        self.hanging = 0
        self.url = ""
        self._runner: Any = None

    async def _run(self, request: Any) -> Any:
        from aiohttp import web

        body = await request.read()
        if json.loads(body)["_ng_task_index"] in self.hang:
            self.hanging += 1
            try:
                await asyncio.sleep(3600)
            finally:
                self.hanging -= 1
        reply = self.fake.handler(httpx.Request("POST", "http://agent/run", content=body))
        return web.Response(status=reply.status_code, body=reply.content, content_type="application/json")

    async def __aenter__(self) -> LoopbackAgent:
        from aiohttp import web

        app = web.Application(handler_args={"handler_cancellation": True})
        app.router.add_post("/run", self._run)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._runner.cleanup()


def every_rollout_accounted(
    records: list[dict[str, Any]], started: int, group_size: int, trained: set[tuple[int, int]]
) -> None:
    """Each started (prompt, rollout) is trained, or has exactly one record: a rollout failure or a
    place in a group record's ``dropped_rollouts``."""
    recorded = [(r["task_index"], r["rollout_index"]) for r in records if r["kind"] == "rollout"]
    recorded += [(r["task_index"], i) for r in records if r["kind"] == "group" for i in r["dropped_rollouts"]]
    assert sorted(recorded + list(trained)) == [(t, i) for t in range(started) for i in range(group_size)]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_regression_a_stall_records_every_rollout_in_flight_as_cancelled(
    tiny: TinyVLM, processor: MediaProcessor, tmp_path: Path
) -> None:
    """``BridgeStalledError`` cancelled the rollouts in flight with only a group record: the 4
    rollouts of the hanging prompt had no record of their own, and the error's ``failures`` were
    the records of stopping instead of the failures that stalled the run."""

    def behaviour(task: int, rollout: int) -> float | int:
        return 1.0 if task == 0 else 422  # 0 completes, 1 and 2 fail (the stall), the rest hang

    failures = tmp_path / "failures.jsonl"
    async with (
        LoopbackAgent(tiny, behaviour, hang=set(range(3, 9))) as agent,
        GymClient(agent.url, max_attempts=1) as client,
    ):
        it = BridgeIterator(
            make_rows(9),
            GymRollouts(client),
            processor,
            BridgeConfig(
                group_size=4, prompts_per_step=4, min_group_size=None, max_consecutive_failed_groups=2
            ),
            failures_path=failures,
        )
        with pytest.raises(BridgeStalledError) as err:
            await asyncio.wait_for(it.__anext__(), 120)
        for _ in range(100):  # the agent sees the cancelled requests' connections close
            if agent.hanging == 0:
                break
            await asyncio.sleep(0.05)
        assert agent.hanging == 0  # the requests in flight were cut off, not left running
    records = read_jsonl(failures)
    assert records == it.failures
    s = it.stats
    assert s.prompts_started == s.groups_completed + s.groups_failed + s.groups_dropped
    assert s.groups_failed == 2 and s.batches == 0
    every_rollout_accounted(records, s.prompts_started, 4, trained=set())
    in_flight = range(3, s.prompts_started)  # started, never answered
    assert len(in_flight) >= 1
    cancelled = [r for r in records if r["kind"] == "rollout" and r["failure_class"] == "cancelled"]
    assert [(r["task_index"], r["rollout_index"]) for r in cancelled] == [
        (t, i) for t in in_flight for i in range(4)
    ]
    stopped = [r for r in records if r["kind"] == "group" and r["task_index"] in in_flight]
    assert [(g["failure_class"], g["rollout_failure_classes"]) for g in stopped] == [
        ("bridge_stopped", {"cancelled": 4})
    ] * len(in_flight)
    assert {f["failure_class"] for f in err.value.failures if f["kind"] == "rollout"} == {"gym_data"}
    assert (s.rollouts_cancelled, s.failure_classes) == (4 * len(in_flight), {"gym_data": 8})


async def test_closing_the_iterator_records_every_rollout_in_flight_as_cancelled(
    tiny: TinyVLM, processor: MediaProcessor, tmp_path: Path
) -> None:
    failures = tmp_path / "failures.jsonl"
    async with (
        LoopbackAgent(tiny, lambda t, r: float(r), hang={2, 3}) as agent,
        GymClient(agent.url, max_attempts=1) as client,
    ):
        it = BridgeIterator(
            make_rows(6),
            GymRollouts(client),
            processor,
            BridgeConfig(
                group_size=2, prompts_per_step=2, min_group_size=None, max_consecutive_failed_groups=8
            ),
            failures_path=failures,
        )
        batch = await asyncio.wait_for(it.__anext__(), 120)
        trained = {(m["task_index"], m["rollout_index"]) for m in batch.metadata}
        it._start_more(2)  # as an async trainer would meet it: the next batch's prompts running
        await asyncio.sleep(0.2)
        await it.aclose()
    records = read_jsonl(failures)
    every_rollout_accounted(records, it.stats.prompts_started, 2, trained)
    assert {(r["task_index"], r["failure_class"]) for r in records if r["kind"] == "rollout"} == {
        (2, "cancelled"),
        (3, "cancelled"),
    }


async def test_regression_cancelling_a_batch_request_records_what_it_held(
    tiny: TinyVLM, processor: MediaProcessor, tmp_path: Path
) -> None:
    """A caller that cancels ``__anext__`` (a timeout around it) took the group it was awaiting and
    the completed groups of the unfinished batch with it, with no record; ``aclose`` never saw them."""
    failures = tmp_path / "failures.jsonl"
    async with (
        LoopbackAgent(tiny, lambda t, r: float(r), hang={1}) as agent,
        GymClient(agent.url, max_attempts=1) as client,
    ):
        it = BridgeIterator(
            make_rows(4),
            GymRollouts(client),
            processor,
            BridgeConfig(
                group_size=2, prompts_per_step=3, min_group_size=None, max_consecutive_failed_groups=8
            ),
            failures_path=failures,
        )
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(it.__anext__(), 3.0)  # group 0 done, 1 hangs, 2 done or pending
        await it.aclose()
    records = read_jsonl(failures)
    every_rollout_accounted(records, it.stats.prompts_started, 2, trained=set())
    s = it.stats
    assert s.prompts_started == 3 == s.groups_completed + s.groups_failed + s.groups_dropped
    assert [r["rollout_index"] for r in records if r["kind"] == "rollout" and r["task_index"] == 1] == [0, 1]
    assert {r["failure_class"] for r in records if r["kind"] == "rollout"} == {"cancelled"}
