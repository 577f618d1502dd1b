"""BridgeIterator over the Gym path (a fake agent behind GymClient): groups, advantages, failures as data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from bridge_helpers import FakeAgent, make_rows

from gymbridge.bridge import BridgeConfig, BridgeIterator, BridgeStalledError, GymRollouts
from gymbridge.client import GymClient
from gymbridge.metrics import PayloadMeter
from gymbridge.models.tiny_vlm import TinyVLM
from gymbridge.tensors import MediaProcessor
from gymbridge.trajectory import Trajectory

G = 4


def _client(agent: FakeAgent) -> GymClient:
    return GymClient(
        "http://agent.test",
        transport=agent.transport(),
        max_attempts=2,
        backoff_initial_s=0.01,
        deadline_s=10,
    )


def _alternating(task: int, rollout: int) -> float:
    return float(rollout % 2 == 0) + 0.1 * task


async def test_groups_become_batches_with_group_advantages(tiny: TinyVLM, processor: MediaProcessor) -> None:
    agent = FakeAgent(tiny, _alternating)
    meter = PayloadMeter(enabled=True)
    async with _client(agent) as client:
        it = BridgeIterator(
            make_rows(4),
            GymRollouts(client, meter=meter),
            processor,
            BridgeConfig(
                group_size=G, prompts_per_step=2, min_group_size=None, max_consecutive_failed_groups=8
            ),
            meter=meter,
        )
        batches = [b async for b in it]
    assert [len(b) for b in batches] == [8, 8]
    b = batches[0]
    assert b.group_ids.tolist() == [0] * 4 + [1] * 4
    assert b.sample_ids.tolist() == list(range(8))
    torch.testing.assert_close(b.rewards[:4], torch.tensor([1.0, 0.0, 1.0, 0.0]))
    assert b.advantages[0] > 0 > b.advantages[1]
    torch.testing.assert_close(b.advantages[:4].sum(), torch.tensor(0.0), atol=1e-5, rtol=0)
    assert [m["task_index"] for m in b.metadata] == [0] * 4 + [1] * 4
    assert [m["rollout_index"] for m in b.metadata[:4]] == [0, 1, 2, 3]
    # one image per prompt: processed once per prompt whatever G is, stored once per prompt
    assert processor.stats.items_processed == 4 and processor.stats.items_requested == 16
    assert b.media["pixel_values"].num_segments == 2 and b.media["pixel_values"].num_refs == 8
    # indices at the row's top level, never inside responses_create_params (genuine servers: 422)
    assert len(agent.seen) == 16
    assert sorted((r["_ng_task_index"], r["_ng_rollout_index"]) for r in agent.seen) == [
        (t, i) for t in range(4) for i in range(G)
    ]
    assert all(set(r["responses_create_params"]) == {"input"} for r in agent.seen)
    report = meter.report()
    assert set(report) == {"gym_request", "gym_return", "prompt_repeat", "rollout_to_policy"}
    assert report["rollout_to_policy"].records == 2 and report["gym_request"].records == 16
    assert report["rollout_to_policy"].dedup_ratio == pytest.approx(4.0)
    assert it.stats.groups_completed == 4 and it.stats.rollouts_ok == 16 and it.failures == []


def test_sync_iteration_and_no_meter_by_default(tiny: TinyVLM, processor: MediaProcessor) -> None:
    agent = FakeAgent(tiny, _alternating)
    client = _client(agent)
    it = BridgeIterator(
        make_rows(3),
        GymRollouts(client),
        processor,
        BridgeConfig(group_size=2, prompts_per_step=2, min_group_size=None, max_consecutive_failed_groups=8),
    )
    sizes = [len(b) for b in it]
    assert sizes == [4, 2]  # the last, partial batch is yielded (drop_last=False)
    it2 = BridgeIterator(
        make_rows(3),
        GymRollouts(_client(agent)),
        processor,
        BridgeConfig(
            group_size=2,
            prompts_per_step=2,
            drop_last=True,
            min_group_size=None,
            max_consecutive_failed_groups=8,
        ),
    )
    assert [len(b) for b in it2] == [4]


async def test_failed_rollouts_are_recorded_and_groups_complete_from_survivors(
    tiny: TinyVLM, processor: MediaProcessor, tmp_path: Path
) -> None:
    def behaviour(task: int, rollout: int) -> float | int | str:
        if task == 0 and rollout == 3:
            return 400  # data failure: not retried
        if task == 1 and rollout >= 1:
            return 503  # infra failure: retried, then given up -> group below min size
        if task == 2 and rollout == 0:
            return "bad_tokens"  # placeholder count does not match the image: whole group build fails
        return _alternating(task, rollout)

    failures = tmp_path / "failures.jsonl"
    agent = FakeAgent(tiny, behaviour)
    async with _client(agent) as client:
        it = BridgeIterator(
            make_rows(4),
            GymRollouts(client),
            processor,
            BridgeConfig(group_size=G, prompts_per_step=2, min_group_size=3, max_consecutive_failed_groups=8),
            failures_path=failures,
        )
        batches = [b async for b in it]
    # task 0 completes from 3 survivors; task 1 fails (1 of 4 succeeded, listed as dropped);
    # task 2's bad rollout is isolated and the group completes from the other 3; task 3 is whole
    assert [len(b) for b in batches] == [6, 4]
    assert [m["task_index"] for m in batches[0].metadata] == [0, 0, 0, 2, 2, 2]
    assert [m["rollout_index"] for m in batches[0].metadata] == [0, 1, 2, 1, 2, 3]
    assert batches[0].group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    s = it.stats
    assert s.prompts_started == 4 == s.groups_completed + s.groups_failed
    assert (s.groups_completed, s.groups_partial, s.groups_failed) == (3, 2, 1)
    assert s.rollouts_failed == 5 and s.rollouts_dropped == 1
    assert s.failure_classes == {"gym_data": 1, "gym_infra": 3, "TrajectoryError": 1}
    assert [
        sum(1 for r in agent.seen if r["_ng_task_index"] == 1 and r["_ng_rollout_index"] == k) for k in (0, 1)
    ] == [1, 2]
    lines = [json.loads(line) for line in failures.read_text().splitlines()]
    assert lines == it.failures
    (group,) = [r for r in lines if r["kind"] == "group"]
    assert group["task_index"] == 1 and group["dropped_rollouts"] == [0] and group["succeeded"] == 1
    assert "only 1 of 4 rollouts succeeded" in group["failure_reason"]
    bad = next(r for r in lines if r["failure_class"] == "TrajectoryError")
    assert (bad["task_index"], bad["rollout_index"]) == (2, 0) and "placeholder" in bad["failure_reason"]
    infra = next(r for r in lines if r["kind"] == "rollout" and r["failure_class"] == "gym_infra")
    assert "503" in infra["failure_reason"] and infra["attempts"] == 2


async def test_a_dead_agent_raises_instead_of_yielding_empty_batches(
    tiny: TinyVLM, processor: MediaProcessor
) -> None:
    agent = FakeAgent(tiny, lambda t, r: 500)
    async with _client(agent) as client:
        it = BridgeIterator(
            make_rows(50),
            GymRollouts(client),
            processor,
            BridgeConfig(
                group_size=2, max_consecutive_failed_groups=3, prompts_per_step=1, min_group_size=None
            ),
        )
        with pytest.raises(BridgeStalledError, match="3 consecutive groups failed") as err:
            await it.__anext__()
    assert it.stats.prompts_started == 3  # stopped early, not after 50 prompts
    assert err.value.failures and all("failure_class" in f for f in err.value.failures)


async def test_a_dataset_with_no_completed_group_raises(
    tiny: TinyVLM, processor: MediaProcessor, tmp_path: Path
) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text('{"responses_create_params": {"input": "hi"}}\nnot json\n')
    agent = FakeAgent(tiny, lambda t, r: 400)
    async with _client(agent) as client:
        it = BridgeIterator(
            path,
            GymRollouts(client),
            processor,
            BridgeConfig(
                group_size=2, max_consecutive_failed_groups=5, prompts_per_step=1, min_group_size=None
            ),
        )
        with pytest.raises(BridgeStalledError, match="without a single completed group"):
            await it.__anext__()
    classes = it.stats.failure_classes
    assert classes == {"gym_data": 2, "bad_row": 2}
    assert it.stats.groups_failed == 2


async def test_regression_sampled_image_placeholder_is_a_recorded_failure(
    tiny: TinyVLM, processor: MediaProcessor
) -> None:
    """A random policy sampled ``<|image_pad|>``; the trainer's VLM forward then crashed on
    "Image features and image tokens do not match". It is now a per-rollout failure."""
    agent = FakeAgent(tiny, lambda t, r: "sampled_pad" if r == 1 else float(r))
    async with _client(agent) as client:
        it = BridgeIterator(
            make_rows(1),
            GymRollouts(client),
            processor,
            BridgeConfig(group_size=3, min_group_size=2, prompts_per_step=1, max_consecutive_failed_groups=8),
        )
        (batch,) = [b async for b in it]
    assert len(batch) == 2 and [m["rollout_index"] for m in batch.metadata] == [0, 2]
    assert int((batch.input_ids == tiny.image_token_id).sum()) == 2 * 4  # only the prompts' placeholders
    (failure,) = it.failures
    assert failure["failure_class"] == "GeneratedPlaceholderToken" and failure["rollout_index"] == 1
    assert "turn 0" in failure["failure_reason"]


async def test_dedup_off_gives_the_same_tensors_with_one_segment_per_row(
    tiny: TinyVLM, processor: MediaProcessor
) -> None:
    batches = {}
    for dedup in (True, False):
        async with _client(FakeAgent(tiny, _alternating)) as client:
            it = BridgeIterator(
                make_rows(2),
                GymRollouts(client),
                processor,
                BridgeConfig(
                    group_size=3,
                    prompts_per_step=2,
                    dedup=dedup,
                    min_group_size=None,
                    max_consecutive_failed_groups=8,
                ),
            )
            (batches[dedup],) = [b async for b in it]
    on, off = batches[True].media["pixel_values"], batches[False].media["pixel_values"]
    assert (on.num_segments, off.num_segments) == (2, 6)
    assert off.physical_nbytes == 3 * on.physical_nbytes == on.logical_nbytes
    torch.testing.assert_close(on.materialize(), off.materialize())
    torch.testing.assert_close(batches[True].advantages, batches[False].advantages)


async def test_reward_fn_shapes_the_trained_reward_and_keeps_the_env_reward(
    tiny: TinyVLM, processor: MediaProcessor
) -> None:
    def shaping(traj: Trajectory) -> float:
        if traj.rollout_index == 2:
            raise ValueError("cannot score this one")
        return traj.reward - 0.1 * traj.rollout_index  # type: ignore[operator]

    async with _client(FakeAgent(tiny, lambda t, r: 1.0)) as client:
        it = BridgeIterator(
            make_rows(1),
            GymRollouts(client),
            processor,
            BridgeConfig(group_size=4, min_group_size=3, prompts_per_step=1, max_consecutive_failed_groups=8),
            reward_fn=shaping,
        )
        (batch,) = [b async for b in it]
    torch.testing.assert_close(batch.rewards, torch.tensor([1.0, 0.9, 0.7]))
    assert [m["env_reward"] for m in batch.metadata] == [1.0, 1.0, 1.0]
    assert batch.advantages[0] > 0 > batch.advantages[2]  # constant env rewards, shaped ones differ
    (failure,) = it.failures
    assert failure["failure_class"] == "RewardFnError" and "cannot score" in failure["failure_reason"]


def test_regression_drop_last_groups_are_recorded_not_silently_lost(
    tiny: TinyVLM, processor: MediaProcessor
) -> None:
    """``drop_last`` used to drop the final partial batch's completed groups without a trace:
    no failure record, no counter. Every prompt must be in a yielded batch or a group record."""
    it = BridgeIterator(
        make_rows(3),
        GymRollouts(_client(FakeAgent(tiny, _alternating))),
        processor,
        BridgeConfig(
            group_size=2,
            prompts_per_step=2,
            drop_last=True,
            min_group_size=None,
            max_consecutive_failed_groups=8,
        ),
    )
    yielded = [m["task_index"] for b in it for m in b.metadata]
    assert sorted(set(yielded)) == [0, 1]
    (record,) = it.failures
    assert record["kind"] == "group" and record["failure_class"] == "drop_last"
    assert record["task_index"] == 2 and record["dropped_rollouts"] == [0, 1]
    assert it.stats.groups_dropped == 1 and it.stats.rollouts_dropped == 2
    s = it.stats
    assert s.prompts_started == 3 == s.groups_completed + s.groups_failed + s.groups_dropped


async def test_regression_masked_rollout_that_fails_the_build_leaves_the_masked_count(
    tiny: TinyVLM, processor: MediaProcessor
) -> None:
    """A ``mask_sample`` rollout isolated as a build failure was still counted in
    ``rollouts_masked`` (only ``rollouts_ok`` was taken back): the counters over-reported
    masked samples that were never trained on."""
    agent = FakeAgent(tiny, lambda t, r: "bad_tokens_masked" if r == 0 else float(r))
    async with _client(agent) as client:
        it = BridgeIterator(
            make_rows(1),
            GymRollouts(client),
            processor,
            BridgeConfig(group_size=3, min_group_size=2, prompts_per_step=1, max_consecutive_failed_groups=8),
        )
        (batch,) = [b async for b in it]
    assert [m["rollout_index"] for m in batch.metadata] == [1, 2]
    assert (it.stats.rollouts_ok, it.stats.rollouts_failed, it.stats.rollouts_masked) == (2, 1, 0)


async def test_each_batch_says_where_the_bridges_time_went(tiny: TinyVLM, processor: MediaProcessor) -> None:
    """``BridgeBatch.timings``: every group of the batch counted; the loop's own work (postprocess,
    build, assemble) is inside the caller's wait."""
    agent = FakeAgent(tiny, _alternating)
    async with _client(agent) as client:
        it = BridgeIterator(
            make_rows(4), GymRollouts(client), processor, BridgeConfig(group_size=G, prompts_per_step=2)
        )
        seen = []
        while True:
            try:
                seen.append((await it.next_batch()).timings)
            except StopAsyncIteration:
                break
    assert len(seen) == 2
    for t in seen:
        assert t.groups == 2 and t.rollouts == 2 * G
        assert t.postprocess_s > 0 and t.build_s > 0 and t.assemble_s > 0 and t.rollouts_s > 0
        assert t.postprocess_s + t.build_s + t.assemble_s <= t.wait_s
        assert set(t.as_dict()) == {
            "wait_s",
            "rollouts_s",
            "postprocess_s",
            "build_s",
            "assemble_s",
            "groups",
            "rollouts",
        }


async def test_failure_records_stream_to_the_file_and_memory_keeps_only_the_newest(
    tiny: TinyVLM, processor: MediaProcessor, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``failures_path``, every record reaches the file and the stats; the iterator holds at
    most twice ``failures_held`` of them however long the run (here: 2 held, 24 recorded)."""
    monkeypatch.setattr(BridgeIterator, "failures_held", 2)

    def behaviour(task: int, rollout: int) -> float | int | str:
        return 400 if rollout == 3 else _alternating(task, rollout)  # one data failure a group

    failures = tmp_path / "failures.jsonl"
    async with _client(FakeAgent(tiny, behaviour)) as client:
        it = BridgeIterator(
            make_rows(24),
            GymRollouts(client),
            processor,
            BridgeConfig(group_size=G, prompts_per_step=2, min_group_size=3),
            failures_path=failures,
        )
        assert len([b async for b in it]) == 12
    lines = [json.loads(line) for line in failures.read_text().splitlines()]
    assert len(lines) == it.stats.rollouts_failed == 24
    assert 2 <= len(it.failures) <= 4 and it.failures == lines[-len(it.failures) :]
