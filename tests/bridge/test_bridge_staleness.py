"""Async GRPO in the bridge: rollouts run ahead by at most ``max_staleness`` policy versions.

A fake two-turn rollout source stamps each turn with the generator's policy version at the
moment the turn is generated; the generator receives each new version after a random lag
(a generator in another process), rollouts and training steps take random times. Whatever
the timings: every trained trajectory is within the bound, every older one is recorded as
``stale``, and every started row is trained once or recorded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gymbridge.bridge import BridgeConfig, BridgeIterator, RolloutRecord

PROMPT = [1, 2, 3]


class Clock:
    """The trainer's version and the (lagging) version the generator samples from."""

    def __init__(self) -> None:
        self.trainer = 0
        self.generator = 0

    async def publish(self, version: int, lag_s: float) -> None:
        await asyncio.sleep(lag_s)
        self.generator = max(self.generator, version)


class TwoTurnSource:
    """Every rollout: two model calls, each stamped with the generator's version when it ran."""

    def __init__(self, clock: Clock, delays_s: list[float]) -> None:
        self.clock = clock
        self.delays_s = delays_s
        self.calls = 0
        self.versions: dict[tuple[int, int], list[int]] = {}

    def _delay(self) -> float:
        self.calls += 1
        return self.delays_s[self.calls % len(self.delays_s)]

    async def _one(self, task: int, rollout: int) -> RolloutRecord:
        items: list[dict[str, Any]] = []
        seen: list[int] = []
        for turn in range(2):
            await asyncio.sleep(self._delay())
            version = self.clock.generator
            prompt = [*seen, 10 + turn] if seen else PROMPT
            gen = [20 + rollout, 30 + turn]
            items.append(
                {
                    "type": "message",
                    "role": "assistant",
                    "id": f"m{turn}",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "x", "annotations": []}],
                    "prompt_token_ids": prompt,
                    "generation_token_ids": gen,
                    "generation_log_probs": [-1.0, -1.0],
                    "policy_version": version,
                }
            )
            self.versions.setdefault((task, rollout), []).append(version)
            seen = prompt + gen
        result = {"response": {"id": "r", "output": items, "status": "completed"}, "reward": float(rollout)}
        return RolloutRecord(task, rollout, result=result)

    async def rollouts(
        self, row: Mapping[str, Any], *, task_index: int, group_size: int
    ) -> list[RolloutRecord]:
        return list(await asyncio.gather(*(self._one(task_index, i) for i in range(group_size))))

    async def aclose(self) -> None:
        return None


async def _loop(
    k: int, prompts: int, group: int, steps: int, delays_s: list[float], train_s: float, lag_s: float
) -> tuple[BridgeIterator, TwoTurnSource, list[tuple[int, list[int]]]]:
    clock = Clock()
    source = TwoTurnSource(clock, delays_s)
    rows = [{"responses_create_params": {"input": f"task {i}"}} for i in range(steps * prompts * 3)]
    bridge = BridgeIterator(
        rows,
        source,
        None,
        BridgeConfig(
            group_size=group,
            prompts_per_step=prompts,
            max_staleness=k,
            max_consecutive_failed_groups=10_000,
            min_group_size=None,
        ),
    )
    trained: list[tuple[int, list[int]]] = []  # (trainer version, tasks trained at it)
    publishers: list[asyncio.Task[None]] = []
    try:
        for _ in range(steps):
            try:
                got = await bridge.next_batch(clock.trainer)
            except StopAsyncIteration:
                break
            trained.append((clock.trainer, got.task_indices))
            for g in got.groups:
                for traj in g.trajectories:
                    assert traj.oldest_policy_version is not None
                    assert clock.trainer - traj.oldest_policy_version <= k
            await asyncio.sleep(train_s)  # the trainer trains; rollouts in flight keep going
            clock.trainer += 1
            publishers.append(asyncio.ensure_future(clock.publish(clock.trainer, lag_s)))
    finally:
        await bridge.aclose()
        await asyncio.gather(*publishers)
    return bridge, source, trained


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    k=st.integers(0, 2),
    prompts=st.integers(1, 2),
    group=st.integers(1, 2),
    delays_s=st.lists(st.sampled_from([0.0, 0.001, 0.003, 0.008]), min_size=1, max_size=6),
    train_s=st.sampled_from([0.0, 0.002, 0.006]),
    lag_s=st.sampled_from([0.0, 0.004, 0.02]),
)
def test_staleness_bound_holds_under_random_timings(
    k: int, prompts: int, group: int, delays_s: list[float], train_s: float, lag_s: float
) -> None:
    bridge, source, trained = asyncio.run(_loop(k, prompts, group, 4, delays_s, train_s, lag_s))
    trained_tasks = [t for _, tasks in trained for t in tasks]
    assert len(trained_tasks) == len(set(trained_tasks))  # no row trained twice
    # every trained rollout's oldest turn, by its recorded versions, is within the bound
    for version, tasks in trained:
        for task in tasks:
            for r in range(group):
                assert version - min(source.versions[(task, r)]) <= k
    stale_groups = [f for f in bridge.failures if f["kind"] == "group" and f["failure_class"] == "stale"]
    stale_rollouts = [f for f in bridge.failures if f["kind"] == "rollout" and f["failure_class"] == "stale"]
    assert len(stale_groups) == bridge.stats.groups_dropped_stale
    assert len(stale_rollouts) == group * len(stale_groups)
    assert all(f["staleness"] > k for f in stale_groups)
    stale_tasks = {f["task_index"] for f in stale_groups}
    assert not stale_tasks & set(trained_tasks)  # a dropped group is never trained
    assert bridge.done_task_indices == set(trained_tasks) | stale_tasks
    if lag_s == 0.0:  # a generator that is never behind the trainer: nothing is ever too old
        assert not stale_groups


def test_on_policy_runs_nothing_ahead() -> None:
    """``max_staleness: 0``: a batch's rollouts start only when it is asked for (today's loop)."""

    async def go() -> tuple[int, int]:
        clock = Clock()
        source = TwoTurnSource(clock, [0.0])
        rows = [{"responses_create_params": {"input": f"t{i}"}} for i in range(6)]
        bridge = BridgeIterator(
            rows,
            source,
            None,
            BridgeConfig(
                group_size=2, prompts_per_step=2, min_group_size=None, max_consecutive_failed_groups=8
            ),
        )
        await bridge.__anext__()
        after_first = bridge.in_flight
        await bridge.aclose()
        ahead = BridgeIterator(
            rows,
            TwoTurnSource(clock, [0.0]),
            None,
            BridgeConfig(
                group_size=2,
                prompts_per_step=2,
                max_staleness=1,
                min_group_size=None,
                max_consecutive_failed_groups=8,
            ),
        )
        await ahead.__anext__()
        in_flight = ahead.in_flight
        await ahead.aclose()
        return after_first, in_flight

    on_policy, run_ahead = asyncio.run(go())
    assert on_policy == 0
    assert run_ahead == 2  # the next batch's two groups run while the caller trains


def test_stale_group_is_recorded_not_trained(tmp_path: Any) -> None:
    """A generator stuck at version 0 while the trainer moves on: groups past the bound are dropped."""

    async def go() -> BridgeIterator:
        clock = Clock()  # the generator never gets a new version
        rows = [{"responses_create_params": {"input": f"t{i}"}} for i in range(4)]
        bridge = BridgeIterator(
            rows,
            TwoTurnSource(clock, [0.0]),
            None,
            BridgeConfig(
                group_size=2,
                max_staleness=1,
                prompts_per_step=1,
                min_group_size=None,
                max_consecutive_failed_groups=8,
            ),
            failures_path=tmp_path / "failures.jsonl",
        )
        await bridge.next_batch(0)
        got = await bridge.next_batch(1)  # one version behind: still trained
        assert [g.staleness for g in got.groups] == [1]
        with pytest.raises(StopAsyncIteration):  # three behind: dropped until the data runs out
            await bridge.next_batch(3)
        return bridge

    bridge = asyncio.run(go())
    assert bridge.stats.groups_dropped_stale == 2
    lines = (tmp_path / "failures.jsonl").read_text().splitlines()
    assert sum('"failure_class":"stale"' in line for line in lines) == 2 * 2 + 2
    assert bridge.stats.prompts_started == bridge.stats.groups_completed + bridge.stats.groups_dropped_stale


def test_on_policy_without_dropping_hands_a_lagging_group_to_the_drift_guard() -> None:
    """``drop_stale=False`` (the launcher, on-policy with the drift guard on): the group is passed on,
    its staleness set, for the trainer's drift guard to fail the step loudly."""

    async def go() -> list[int]:
        rows = [{"responses_create_params": {"input": f"t{i}"}} for i in range(2)]
        bridge = BridgeIterator(
            rows,
            TwoTurnSource(Clock(), [0.0]),
            None,
            BridgeConfig(
                group_size=2,
                drop_stale=False,
                prompts_per_step=1,
                min_group_size=None,
                max_consecutive_failed_groups=8,
            ),
        )
        got = await bridge.next_batch(1)  # the generator never got version 1
        await bridge.aclose()
        return [g.staleness for g in got.groups]

    assert asyncio.run(go()) == [1]
