"""Nothing disappears on any exception path of ``next_batch`` (issue 39, item 8).

Every started prompt ends in a yielded batch or a group record, and every rollout of it in a
batch or a record, whether the exception comes from the source, the group's task, the rows, the
batch's assembly or the payload meter.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson
import pytest
from bridge_helpers import FakeAgent, make_rows

from gymbridge.bridge import BridgeConfig, BridgeIterator, GymRollouts, RolloutRecord
from gymbridge.client import GymClient
from gymbridge.models.tiny_vlm import TinyVLM
from gymbridge.tensors import MediaProcessor, TrainBatch

GROUP = 2


def accounted(it: BridgeIterator, yielded: set[int], *, raised: set[int] = frozenset()) -> None:  # type: ignore[assignment]
    """Every started prompt is in a yielded batch or has a group record; each rollout once.

    ``raised``: prompts whose group's task raised (their rollouts are recorded by class, the group
    as ``bridge_stopped``).
    """
    s = it.stats
    assert s.prompts_started == s.groups_completed + s.groups_failed + s.groups_dropped
    groups = {f["task_index"] for f in it.failures if f["kind"] == "group"}
    assert set(range(s.prompts_started)) == yielded | groups and not yielded & groups
    rollouts = [(f["task_index"], f["rollout_index"]) for f in it.failures if f["kind"] == "rollout"]
    rollouts += [
        (f["task_index"], i) for f in it.failures if f["kind"] == "group" for i in f["dropped_rollouts"]
    ]
    rollouts += [(t, i) for t in yielded for i in range(GROUP)]
    assert sorted(rollouts) == [(t, i) for t in range(s.prompts_started) for i in range(GROUP)]
    assert raised <= groups


def on_disk(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


class Source:
    """The fake agent's rollouts; ``wrong_count`` tasks get one record too few, ``fail`` tasks fail."""

    def __init__(
        self, tiny: TinyVLM, wrong_count: set[int] = frozenset(), fail: set[int] = frozenset()
    ) -> None:  # type: ignore[assignment]
        agent = FakeAgent(tiny, lambda t, r: 422 if t in fail else float(r))
        self.client = GymClient("http://agent.test", transport=agent.transport(), max_attempts=1)
        self.inner = GymRollouts(self.client)
        self.wrong_count = wrong_count

    async def rollouts(
        self, row: Mapping[str, Any], *, task_index: int, group_size: int
    ) -> list[RolloutRecord]:
        records = await self.inner.rollouts(row, task_index=task_index, group_size=group_size)
        return records[:-1] if task_index in self.wrong_count else records

    async def aclose(self) -> None:
        await self.client.aclose()


def bridge(
    source: Source, processor: MediaProcessor, tmp_path: Path, rows: Any = None, **kw: Any
) -> BridgeIterator:
    config = BridgeConfig(
        group_size=GROUP, prompts_per_step=3, min_group_size=None, max_consecutive_failed_groups=8
    )
    return BridgeIterator(
        make_rows(6) if rows is None else rows,
        source,
        processor,
        config,
        failures_path=tmp_path / "failures.jsonl",
        **kw,
    )


async def test_regression_a_source_returning_the_wrong_number_of_records_is_recorded_not_raised(
    tiny: TinyVLM, processor: MediaProcessor, tmp_path: Path
) -> None:
    """A short group raised ``RuntimeError`` inside its task; ``next_batch`` re-raised it after
    popping the task, so its rollouts and the groups already held for the batch had no record."""
    source = Source(tiny, wrong_count={1})
    it = bridge(source, processor, tmp_path)
    batch = await it.next_batch()
    assert batch.task_indices == [0, 2, 3]
    failed = [f for f in it.failures if f["task_index"] == 1 and f["kind"] == "rollout"]
    assert [f["failure_class"] for f in failed] == ["source_contract"] * GROUP
    assert "returned 1 records for a group of 2" in failed[0]["failure_reason"]
    await it.aclose()
    accounted(it, yielded={0, 2, 3})
    assert on_disk(tmp_path / "failures.jsonl") == it.failures
    await source.aclose()


async def test_regression_a_group_task_that_raises_records_the_groups_held_for_the_batch(
    tiny: TinyVLM, processor: MediaProcessor, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = Source(tiny)
    it = bridge(source, processor, tmp_path)
    real = it._run_group

    async def run_group(task_index: int, row: Any, started_version: int = 0) -> Any:
        if task_index == 1:
            raise OSError("disk full")
        return await real(task_index, row, started_version)

    monkeypatch.setattr(it, "_run_group", run_group)
    with pytest.raises(OSError, match="disk full"):
        await it.next_batch()
    await it.aclose()
    accounted(it, yielded=set(), raised={1})
    held = [f for f in it.failures if f["kind"] == "group" and f["task_index"] == 0]
    assert held[0]["failure_class"] == "bridge_stopped" and "OSError: disk full" in held[0]["failure_reason"]
    assert on_disk(tmp_path / "failures.jsonl") == it.failures
    await source.aclose()


async def test_regression_rows_that_raise_record_the_groups_held_for_the_batch(
    tiny: TinyVLM, processor: MediaProcessor, tmp_path: Path
) -> None:
    def rows() -> Iterator[dict[str, Any]]:
        yield from make_rows(3)
        raise ValueError("the dataset reader broke")

    source = Source(tiny, fail={1})  # task 0 is held, 1 fails: the row drawn in its place raises
    it = bridge(source, processor, tmp_path, rows=rows())
    with pytest.raises(ValueError, match="dataset reader broke"):
        await it.next_batch()
    await it.aclose()
    accounted(it, yielded=set())
    held = [f for f in it.failures if f["kind"] == "group" and f["task_index"] == 0]
    assert [f["failure_class"] for f in held] == ["bridge_stopped"]
    assert on_disk(tmp_path / "failures.jsonl") == it.failures
    await source.aclose()


class BrokenMeter:
    def record(self, boundary: str, payload: Any) -> None:
        raise RuntimeError("meter broke")


@pytest.mark.parametrize("where", ["cat", "meter"])
async def test_regression_an_assembly_failure_records_the_groups_of_the_batch(
    tiny: TinyVLM, processor: MediaProcessor, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The groups were marked done before ``TrainBatch.cat`` and the meter ran; an exception there
    dropped them with no record (a resume would have skipped them as done)."""

    def cat(*args: Any, **kwargs: Any) -> TrainBatch:
        raise RuntimeError("cat broke")

    if where == "cat":
        monkeypatch.setattr(TrainBatch, "cat", cat)
    source = Source(tiny)
    it = bridge(source, processor, tmp_path, meter=BrokenMeter() if where == "meter" else None)
    with pytest.raises(RuntimeError, match=f"{where} broke"):
        await it.next_batch()
    await it.aclose()
    assert {0, 1, 2} <= it.done_task_indices
    accounted(it, yielded=set())
    stopped = {f["task_index"] for f in it.failures if f["failure_class"] == "bridge_stopped"}
    assert stopped >= {0, 1, 2} and it.stats.batches == 0
    assert on_disk(tmp_path / "failures.jsonl") == it.failures
    await source.aclose()
