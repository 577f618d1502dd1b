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
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "run"))

from run_helpers import counter_gym_run, stand_in_metrics  # noqa: E402  (the stack the async test runs)

from gymbridge.tensors import TrainBatch  # noqa: E402
from gymbridge.trainer.grpo import StepMetrics  # noqa: E402


async def timed_loop(max_staleness: int, delay_s: float, train_s: float, steps: int, run_dir: Path) -> float:
    def update(batch: TrainBatch) -> StepMetrics:
        time.sleep(train_s)
        return stand_in_metrics(batch, train_s)

    async with counter_gym_run(
        run_dir,
        steps=steps,
        max_staleness=max_staleness,
        delay_s=delay_s,
        make_update=lambda _model: update,
        publish=lambda _version: 0.0,
    ) as (run, _, _bridge):
        started = time.perf_counter()
        for _ in range(steps):
            if await run.step() is None:
                raise RuntimeError("the rows ran out before the last step")
        return time.perf_counter() - started


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
