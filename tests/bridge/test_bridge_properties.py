"""Property: whatever fails where, no rollout and no prompt disappears, and no batch is empty."""

from __future__ import annotations

import asyncio

import hypothesis.strategies as st
from bridge_helpers import FakeAgent, make_rows
from hypothesis import HealthCheck, given, settings

from gymbridge.bridge import BridgeConfig, BridgeIterator, BridgeStalledError, GymRollouts
from gymbridge.client import GymClient
from gymbridge.models.tiny_vlm import TinyVLM
from gymbridge.tensors import MediaProcessor

OUTCOMES = st.sampled_from([0.0, 1.0, 0.5, 400, 503, "bad_tokens", "sampled_pad"])


def drain(
    tiny: TinyVLM,
    outcomes: list[float | int | str],
    num_prompts: int,
    group_size: int,
    prompts_per_batch: int,
    min_group: int,
    *,
    drop_last: bool = False,
) -> tuple[BridgeIterator, list[list[tuple[int, int]]], bool]:
    """Run a bridge over a fake agent to the end: the iterator, each batch's (task, rollout) pairs
    (checked non-empty and at most ``prompts_per_batch`` groups), and whether it stalled."""
    agent = FakeAgent(tiny, lambda t, r: outcomes[(t * group_size + r) % len(outcomes)])

    async def run() -> tuple[BridgeIterator, list[list[tuple[int, int]]], bool]:
        async with GymClient(
            "http://agent.test", transport=agent.transport(), max_attempts=1, deadline_s=10
        ) as client:
            it = BridgeIterator(
                make_rows(num_prompts),
                GymRollouts(client),
                MediaProcessor(tiny.processor),
                BridgeConfig(
                    group_size=group_size,
                    prompts_per_step=prompts_per_batch,
                    min_group_size=min_group,
                    max_consecutive_failed_groups=100,
                    drop_last=drop_last,
                ),
            )
            seen: list[list[tuple[int, int]]] = []
            stalled = False
            try:
                async for batch in it:
                    seen.append([(m["task_index"], m["rollout_index"]) for m in batch.metadata])
                    assert len(batch) > 0 and len(set(batch.group_ids.tolist())) <= prompts_per_batch
            except BridgeStalledError:
                stalled = True
            return it, seen, stalled

    return asyncio.run(run())


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    num_prompts=st.integers(1, 5),
    group_size=st.integers(1, 4),
    prompts_per_batch=st.integers(1, 3),
    min_frac=st.floats(0.0, 1.0),
    outcomes=st.lists(OUTCOMES, min_size=20, max_size=20),
)
def test_every_rollout_is_trained_on_or_recorded(
    tiny: TinyVLM,
    num_prompts: int,
    group_size: int,
    prompts_per_batch: int,
    min_frac: float,
    outcomes: list[float | int | str],
) -> None:
    min_group = max(1, round(min_frac * group_size))
    it, seen, stalled = drain(tiny, outcomes, num_prompts, group_size, prompts_per_batch, min_group)
    trained = [pair for batch in seen for pair in batch]
    failed = [(f["task_index"], f["rollout_index"]) for f in it.failures if f["kind"] == "rollout"]
    dropped = [
        (f["task_index"], r) for f in it.failures if f["kind"] == "group" for r in f["dropped_rollouts"]
    ]
    everything = sorted(trained + failed + dropped)
    assert everything == [(t, r) for t in range(num_prompts) for r in range(group_size)]  # once each
    s = it.stats
    assert s.prompts_started == num_prompts == s.groups_completed + s.groups_failed
    assert s.rollouts_ok + s.rollouts_failed == num_prompts * group_size
    assert s.rollouts_dropped == len(dropped)
    failed_groups = {f["task_index"] for f in it.failures if f["kind"] == "group"}
    assert len(failed_groups) == s.groups_failed
    assert not failed_groups & {t for t, _ in trained}  # a failed group never reaches a batch
    assert stalled == (s.groups_completed == 0)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    num_prompts=st.integers(1, 5),
    group_size=st.integers(1, 3),
    prompts_per_batch=st.integers(1, 3),
    outcomes=st.lists(OUTCOMES, min_size=15, max_size=15),
)
def test_drop_last_loses_no_prompt_silently(
    tiny: TinyVLM,
    num_prompts: int,
    group_size: int,
    prompts_per_batch: int,
    outcomes: list[float | int | str],
) -> None:
    """With ``drop_last`` every rollout is still trained on, a failure, or listed in a group record."""
    it, seen, stalled = drain(tiny, outcomes, num_prompts, group_size, prompts_per_batch, 1, drop_last=True)
    assert all(len({g for g, _ in batch}) == prompts_per_batch for batch in seen)  # only full batches
    trained = [pair for batch in seen for pair in batch]
    failed = [(f["task_index"], f["rollout_index"]) for f in it.failures if f["kind"] == "rollout"]
    dropped = [
        (f["task_index"], r) for f in it.failures if f["kind"] == "group" for r in f["dropped_rollouts"]
    ]
    assert sorted(trained + failed + dropped) == [
        (t, r) for t in range(num_prompts) for r in range(group_size)
    ]
    s = it.stats
    assert s.prompts_started == num_prompts == s.groups_completed + s.groups_failed + s.groups_dropped
    assert s.groups_completed % prompts_per_batch == 0 and s.groups_dropped < prompts_per_batch
    dropped_groups = {f["task_index"] for f in it.failures if f.get("failure_class") == "drop_last"}
    assert len(dropped_groups) == s.groups_dropped and not dropped_groups & {t for t, _ in trained}
    assert stalled == (s.groups_completed + s.groups_dropped == 0)
