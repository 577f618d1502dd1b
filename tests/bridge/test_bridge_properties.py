"""Property: whatever fails where, no rollout and no prompt disappears, and no batch is empty."""

from __future__ import annotations

import asyncio

import hypothesis.strategies as st
from bridge_helpers import FakeAgent, make_rows
from hypothesis import HealthCheck, given, settings

from gymbridge.bridge import BridgeIterator, BridgeStalledError, GymRollouts
from gymbridge.client import GymClient
from gymbridge.tensors import MediaProcessor
from gymbridge.testing.tiny_vlm import TinyVLM

OUTCOMES = st.sampled_from([0.0, 1.0, 0.5, 400, 503, "bad_tokens", "sampled_pad"])


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
    agent = FakeAgent(tiny, lambda t, r: outcomes[(t * group_size + r) % len(outcomes)])

    async def run() -> tuple[BridgeIterator, list[list[tuple[int, int]]], bool]:
        async with GymClient(
            "http://agent.test", transport=agent.transport(), max_attempts=1, deadline_s=10
        ) as client:
            it = BridgeIterator(
                make_rows(num_prompts),
                GymRollouts(client),
                MediaProcessor(tiny.processor),
                group_size=group_size,
                prompts_per_batch=prompts_per_batch,
                min_group_size=min_group,
                max_consecutive_failed_groups=100,
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

    it, seen, stalled = asyncio.run(run())
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
