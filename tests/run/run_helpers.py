"""Helpers of the run's tests: configs from the shipped overlays plus dotted settings, quiet runs,
and a run's steps over the Gym path on loopback with a stand-in update (also used by
benchmarks/async_loop_bench.py)."""

from __future__ import annotations

import contextlib
import io
import re
import socket
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gymbridge.bridge import BridgeConfig, BridgeIterator, GymRollouts
from gymbridge.client import GymClient
from gymbridge.run import GRPORun, RunConfig, RunDir, RunSummary, load_run_config, train
from gymbridge.run.model import RunModel
from gymbridge.server import SimpleAgent, start_server
from gymbridge.server.examples import CounterEnv, counter_rows
from gymbridge.tensors import TrainBatch
from gymbridge.testing.scripted_model import ScriptedModelServer
from gymbridge.trainer import GRPOTrainer, tiny_policy
from gymbridge.trainer.grpo import StepMetrics

Update = Callable[[TrainBatch], StepMetrics]

SMALL: dict[str, Any] = {
    "steps": 2,
    "bridge.prompts_per_step": 1,
    "bridge.group_size": 2,
    "rollout.max_tokens": 6,
    "warmup.steps": 0,
}
"""A two-step colour run of 2 rollouts a step, without the format warm-up (seconds, not minutes)."""


def run_config(
    run_dir: Path | str | None,
    settings: Mapping[str, Any] | None = None,
    configs: Sequence[str] = ("smoke",),
) -> RunConfig:
    """``configs`` (shipped overlays) with ``settings`` (dotted keys) over them, in ``run_dir``."""
    overrides = list((settings or {}).items())
    if run_dir is not None:
        overrides.append(("output.run_dir", str(run_dir)))
    return load_run_config(list(configs), overrides)


def quiet_train(cfg: RunConfig, **kwargs: Any) -> tuple[RunSummary, str]:
    """Run ``cfg``; returns its summary and what the console printed."""
    out = io.StringIO()
    summary = train(cfg, out=out, **kwargs)
    return summary, out.getvalue()


def ports(text: str) -> list[int]:
    """The ports of the ``servers:`` line a run printed."""
    line = next(line for line in text.splitlines() if line.startswith("servers:"))
    return [int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", line)]


def closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def stand_in_metrics(batch: TrainBatch, step_s: float) -> StepMetrics:
    """What a stand-in update that took ``step_s`` reports for ``batch`` (zero loss, no clipping)."""
    tokens = int(batch.loss_mask.sum())
    return StepMetrics(0.0, 0.0, 0.0, len(batch), batch.num_tokens, tokens, 0.0, 0.0, 1.0, 0.0, step_s)


@contextlib.asynccontextmanager
async def counter_gym_run(
    run_dir: Path,
    *,
    steps: int,
    max_staleness: int,
    delay_s: float,
    make_update: Callable[[ScriptedModelServer], Update],
    publish: Callable[[int], float],
    group_size: int = 2,
) -> AsyncIterator[tuple[GRPORun, ScriptedModelServer, BridgeIterator]]:
    """A :class:`GRPORun` over the Gym path on loopback: CounterEnv + SimpleAgent + a scripted model
    server whose every call sleeps ``delay_s``, one prompt of ``group_size`` rollouts a step (rows
    for ``2 * steps`` steps), ``make_update(model server)`` as the trainer update. Everything is
    stopped on the way out."""
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
            group_size=group_size,
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
        update=make_update(model),
        publish=publish,
    )
    try:
        yield run, model, bridge
    finally:
        await run.cleanup()
        await client.aclose()
        await agent.stop()
        await model.stop()
        await env.stop()
