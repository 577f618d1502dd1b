"""DAPO dynamic sampling in the bridge: zero-variance groups are left out, recorded, and replaced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bridge_helpers import FakeAgent, make_rows

from gymbridge.bridge import BridgeConfig, BridgeIterator, GymRollouts
from gymbridge.client import GymClient
from gymbridge.models.tiny_vlm import TinyVLM
from gymbridge.tensors import MediaProcessor

G = 2


def _client(agent: FakeAgent) -> GymClient:
    return GymClient("http://agent.test", transport=agent.transport(), max_attempts=1, deadline_s=10)


def _even_tasks_are_solved_always(task: int, rollout: int) -> float:
    """Even tasks: every rollout gets 1.0 (no signal); odd tasks: 1.0 / 0.0 (signal)."""
    return 1.0 if task % 2 == 0 else float(rollout % 2 == 0)


def _dynamic(
    client: GymClient, processor: MediaProcessor, rows: int, rounds: int, **kw: object
) -> BridgeIterator:
    config = BridgeConfig(
        group_size=G,
        prompts_per_step=2,
        min_group_size=None,
        max_consecutive_failed_groups=8,
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=rounds,
    )
    return BridgeIterator(make_rows(rows), GymRollouts(client), processor, config, **kw)  # type: ignore[arg-type]


def _records(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def test_zero_variance_groups_are_replaced_by_new_prompts_and_recorded(
    tiny: TinyVLM, processor: MediaProcessor, tmp_path: Path
) -> None:
    failures = tmp_path / "failures.jsonl"
    agent = FakeAgent(tiny, _even_tasks_are_solved_always)
    async with _client(agent) as client:
        it = _dynamic(client, processor, 8, 2, failures_path=failures)
        first = await it.next_batch()
        dropped_first = [g.task_index for g in first.dropped_zero_variance]
        await it.aclose()
    # tasks 0 and 2 carry no signal: the batch is full with tasks 1 and 3 instead
    assert first.task_indices == [1, 3] and dropped_first == [0, 2]
    assert len(first.batch) == 2 * G
    assert all(len({t.reward for t in g.trajectories}) > 1 for g in first.groups)
    assert it.stats.groups_zero_variance_dropped == 2
    dropped = [r for r in _records(failures) if r["failure_class"] == "zero_variance"]
    assert [r["task_index"] for r in dropped] == [0, 2]
    assert dropped[0]["rewards"] == [1.0, 1.0] and dropped[0]["dropped_rollouts"] == [0, 1]
    assert "no learning signal" in str(dropped[0]["failure_reason"])
    s = it.stats
    assert (
        s.prompts_started
        == (s.groups_completed + s.groups_failed + s.groups_dropped + s.groups_dropped_stale)
        + s.groups_zero_variance_dropped
    )


async def test_without_dynamic_sampling_zero_variance_groups_are_trained(
    tiny: TinyVLM, processor: MediaProcessor
) -> None:
    agent = FakeAgent(tiny, _even_tasks_are_solved_always)
    async with _client(agent) as client:
        it = BridgeIterator(
            make_rows(4),
            GymRollouts(client),
            processor,
            BridgeConfig(
                group_size=G, prompts_per_step=2, min_group_size=None, max_consecutive_failed_groups=8
            ),
        )
        got = await it.next_batch()
        await it.aclose()
    assert got.task_indices == [0, 1]
    assert it.stats.groups_zero_variance == 1 and it.stats.groups_zero_variance_dropped == 0


@pytest.mark.parametrize("rounds", [0, 1])
async def test_the_extra_rounds_are_bounded_then_zero_variance_groups_fill_the_batch(
    tiny: TinyVLM, processor: MediaProcessor, rounds: int
) -> None:
    agent = FakeAgent(tiny, lambda task, rollout: 1.0)  # nothing ever has signal
    async with _client(agent) as client:
        it = _dynamic(client, processor, 10, rounds)
        got = await it.next_batch()
        await it.aclose()
    # at most rounds x prompts_per_step groups dropped, then the batch fills (never a stall)
    assert len(got.dropped_zero_variance) == 2 * rounds
    assert len(got.batch) == 2 * G and len(got.groups) == 2
    assert len({int(row["_ng_task_index"]) for row in agent.seen}) == 2 + 2 * rounds
