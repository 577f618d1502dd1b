"""What async GRPO (``max_staleness: 1``) saves over on-policy when rollouts and updates are both slow.

    .venv/bin/python benchmarks/async_loop_bench.py [--delay 0.5] [--train 0.5] [--steps 4]

The Gym path on loopback (CounterEnv + SimpleAgent + a scripted model server whose every call
sleeps ``--delay`` s), a trainer update that sleeps ``--train`` s, and
:meth:`gymbridge.run.GRPORun.step` driving both, once on-policy and once with
``max_staleness: 1``, side by side in one run. On-policy takes about ``steps * (delay + train)``;
async about ``delay + steps * max(delay, train)``. Prints both times and their ratio (the goal:
above 1.25x at the defaults). tests/run/test_async_steps.py checks the overlap itself.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

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


async def timed_loop(max_staleness: int, delay_s: float, train_s: float, steps: int, run_dir: Path) -> float:
    def update(batch: TrainBatch) -> StepMetrics:
        time.sleep(train_s)
        tokens = int(batch.loss_mask.sum())
        return StepMetrics(0.0, 0.0, 0.0, len(batch), batch.num_tokens, tokens, 0.0, 0.0, 1.0, 0.0, train_s)

    env = await start_server(CounterEnv())
    model = ScriptedModelServer([{"text": "done", "delay_s": delay_s}])
    await model.start()
    agent = await start_server(SimpleAgent(resources_url=env.url, model_url=model.url))
    client = GymClient(agent.url, deadline_s=60)
    bridge = BridgeIterator(
        counter_rows(steps * 2),
        GymRollouts(client),
        None,
        BridgeConfig(
            group_size=2,
            max_staleness=max_staleness,
            prompts_per_step=1,
            min_group_size=None,
            max_consecutive_failed_groups=8,
        ),
    )
    config = RunConfig.model_validate({"steps": steps, "bridge": {"max_staleness": max_staleness}})
    policy = tiny_policy(0)
    run = GRPORun.from_parts(
        config,
        run_dir=RunDir.create(run_dir),
        model=RunModel("tiny", None, None, policy, (), tiny_policy, "--tiny"),
        trainer=GRPOTrainer(policy),
        bridge=bridge,
        update=update,
        publish=lambda v: 0.0,
    )
    try:
        started = time.perf_counter()
        for _ in range(steps):
            if await run.step() is None:
                raise RuntimeError("the rows ran out before the last step")
        return time.perf_counter() - started
    finally:
        await run.cleanup()
        await client.aclose()
        await agent.stop()
        await model.stop()
        await env.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay", type=float, default=0.5, help="seconds per model call")
    parser.add_argument("--train", type=float, default=0.5, help="seconds per update")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sync_s = asyncio.run(timed_loop(0, args.delay, args.train, args.steps, Path(tmp) / "sync"))
        async_s = asyncio.run(timed_loop(1, args.delay, args.train, args.steps, Path(tmp) / "async"))
    print(f"{'loop':<28} {'s':>7}   ({args.steps} steps, {args.delay} s per call, {args.train} s per update)")
    print(f"{'on-policy (max_staleness 0)':<28} {sync_s:7.2f}")
    print(f"{'async (max_staleness 1)':<28} {async_s:7.2f}")
    print(f"{'on-policy / async':<28} {sync_s / async_s:6.2f}x")


if __name__ == "__main__":
    main()
