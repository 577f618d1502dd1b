"""Async GRPO through the run's own step: the next batch's rollouts run while the trainer trains.

The Gym path on loopback (CounterEnv + SimpleAgent + a scripted model server whose every
call sleeps), a trainer update, and :meth:`gymbridge.run.GRPORun.step` driving both: with
``max_staleness: 1`` the next batch's model calls reach the model server while the update of
this batch runs; on-policy (``max_staleness: 0``) none does. The update counts the model
server's calls when it starts and ends: that record, not a speed ratio, is the overlap. What
the overlap is worth in time: benchmarks/async_loop_bench.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gymbridge.bridge import BridgeConfig, BridgeIterator, GymRollouts
from gymbridge.client import GymClient
from gymbridge.run import GRPORun, RunConfig, RunDir
from gymbridge.run.model import RunModel
from gymbridge.server import SimpleAgent, start_server
from gymbridge.server.examples import CounterEnv, counter_rows
from gymbridge.tensors import TrainBatch
from gymbridge.testing.scripted_model import ScriptedModelServer
from gymbridge.trainer import GRPOTrainer, tiny_policy
from gymbridge.trainer.grpo import StepMetrics

pytestmark = pytest.mark.integration

DELAY_S = 0.2  # per model call (one call per rollout)
TRAIN_S = 0.5  # per on-policy update: time enough for a wrongly early next batch to show
OVERLAP_WAIT_S = 60.0  # an async update trains until the next batch reaches the model, at most this
GROUP = 2  # rollouts per batch: one prompt per batch, so GROUP model calls
STEPS = 4


def recording_update(
    model: ScriptedModelServer, wait_for_next_batch: bool, seen: list[tuple[int, int]]
) -> Callable[[TrainBatch], StepMetrics]:
    """An update that records ``(model calls at its start, model calls at its end)``.

    ``wait_for_next_batch``: it trains until the next batch's calls have reached the model (the
    overlap), giving up ``OVERLAP_WAIT_S`` after the first update began: only a loop that does not
    overlap waits that out.
    """
    give_up_at: list[float] = []

    def update(batch: TrainBatch) -> StepMetrics:
        step = len(seen) + 1
        at_start = model.num_calls
        if wait_for_next_batch:
            if not give_up_at:
                give_up_at.append(time.monotonic() + OVERLAP_WAIT_S)
            while model.num_calls < GROUP * (step + 1) and time.monotonic() < give_up_at[0]:
                time.sleep(0.01)
        else:
            time.sleep(TRAIN_S)
        seen.append((at_start, model.num_calls))
        tokens = int(batch.loss_mask.sum())
        return StepMetrics(0.0, 0.0, 0.0, len(batch), batch.num_tokens, tokens, 0.0, 0.0, 1.0, 0.0, TRAIN_S)

    return update


async def run_loop(max_staleness: int, run_dir: Path) -> tuple[list[tuple[int, int]], list[int], list[int]]:
    env = await start_server(CounterEnv())
    model = ScriptedModelServer([{"text": "done", "delay_s": DELAY_S}])
    await model.start()
    agent = await start_server(SimpleAgent(resources_url=env.url, model_url=model.url))
    client = GymClient(agent.url, deadline_s=30)
    bridge = BridgeIterator(
        counter_rows(STEPS * 2),
        GymRollouts(client),
        None,
        BridgeConfig(
            group_size=GROUP,
            max_staleness=max_staleness,
            prompts_per_step=1,
            min_group_size=None,
            max_consecutive_failed_groups=8,
        ),
    )
    published: list[int] = []

    def publish(version: int) -> float:
        published.append(version)
        return 0.0

    seen: list[tuple[int, int]] = []
    staleness: list[int] = []
    config = RunConfig.model_validate({"steps": STEPS, "bridge": {"max_staleness": max_staleness}})
    policy = tiny_policy(0)
    run = GRPORun.from_parts(
        config,
        run_dir=RunDir.create(run_dir),
        model=RunModel("tiny", None, None, policy, (), tiny_policy, "--tiny"),
        trainer=GRPOTrainer(policy),
        bridge=bridge,
        update=recording_update(model, wait_for_next_batch=max_staleness > 0, seen=seen),
        publish=publish,
    )
    try:
        for _ in range(STEPS):
            report = await run.step()
            assert report is not None
            staleness.append(report.record()["staleness_max"])
    finally:
        await run.cleanup()
        await client.aclose()
        await agent.stop()
        await model.stop()
        await env.stop()
    assert bridge.stats.rollouts_failed == 0, bridge.failures
    return seen, published, staleness


def test_async_runs_the_next_batch_during_the_update_and_sync_does_not(tmp_path: Path) -> None:
    sync_seen, sync_published, sync_staleness = asyncio.run(run_loop(0, tmp_path / "sync"))
    async_seen, async_published, async_staleness = asyncio.run(run_loop(1, tmp_path / "async"))
    assert sync_published == async_published == [1, 2, 3, 4]  # one version per optimizer step
    assert sync_staleness == [0, 0, 0, 0]
    assert async_staleness == [0, 1, 1, 1]  # batch n+1 was generated by version n-1
    # on-policy: update k sees batch k's calls only, from start to end (nothing runs ahead)
    assert sync_seen == [(GROUP * k, GROUP * k) for k in range(1, STEPS + 1)]
    # max_staleness 1: batch k+1's calls reach the model while update k runs, and no further batch's
    for k, (at_start, at_end) in enumerate(async_seen, 1):
        assert GROUP * k <= at_start <= at_end == GROUP * (k + 1), async_seen
