"""Measure the example environments: data generation cost and rollout overhead without a model.

Run ``python -m gymbridge_envs.bench [--rows 40] [--rollouts 64] [--concurrency 32]`` from the
repository root. For each environment it prints: generation time per row and JSON bytes per
row; then rollouts through gymbridge's ``SimpleAgent`` with a ``ScriptedModelServer``
replaying each row's oracle solution (so every reward must be 1.0 and the time is pure
agent + environment + HTTP overhead): rollouts/s, p50/p99 latency, mean model calls per
rollout. Everything runs in one process on loopback; numbers are relative to the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import httpx
import orjson

from gymbridge.server import SimpleAgent
from gymbridge.testing.scripted_model import ScriptedModelServer, call_index
from gymbridge_envs import list_envs
from gymbridge_envs._testing import oracle_script, running


def _tagged(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with ``metadata.bench_row`` set, so the scripted model knows which oracle to replay."""
    out = []
    for i, row in enumerate(rows):
        params = dict(row["responses_create_params"])
        params["metadata"] = {**params.get("metadata", {}), "bench_row": str(i)}
        out.append({**row, "responses_create_params": params})
    return out


async def _bench_env(
    name: str, rows: list[dict[str, Any]], rollouts: int, concurrency: int
) -> dict[str, Any]:
    from gymbridge_envs import get_env

    spec = get_env(name)
    rows = _tagged(rows)
    scripts = {r["responses_create_params"]["metadata"]["bench_row"]: oracle_script(name, r) for r in rows}

    def script(request: dict[str, Any]) -> Any:
        steps = scripts[request["metadata"]["bench_row"]]
        return steps[min(call_index(request), len(steps) - 1)]

    model = ScriptedModelServer(script)
    model.keep_requests = False
    latencies: list[float] = []
    rewards: list[float] = []
    async with model, running(spec.make_server()) as env_url:
        agent = SimpleAgent(
            resources_url=env_url, model_url=model.url, gymnasium=spec.style == "gymnasium", max_steps=32
        )
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with running(agent) as agent_url, httpx.AsyncClient(timeout=120, limits=limits) as client:
            gate = asyncio.Semaphore(concurrency)

            async def one(row: dict[str, Any]) -> None:
                async with gate:
                    t0 = time.perf_counter()
                    reply = await client.post(f"{agent_url}/run", json=row)
                    latencies.append(time.perf_counter() - t0)
                    reply.raise_for_status()
                    rewards.append(float(reply.json()["reward"]))

            started = time.perf_counter()
            await asyncio.gather(*(one(rows[i % len(rows)]) for i in range(rollouts)))
            wall = time.perf_counter() - started
    latencies.sort()
    return {
        "rollouts_per_s": rollouts / wall,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))],
        "mean_reward": statistics.fmean(rewards),
        "calls_per_rollout": model.num_calls / rollouts,
    }


async def _main(args: argparse.Namespace) -> None:
    print(
        f"| env | gen ms/row | KiB/row | rollouts/s (c={args.concurrency}) "
        "| p50 ms | p99 ms | model calls | reward |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for spec in list_envs():
        t0 = time.perf_counter()
        rows = list(spec.generate(args.rows, seed=0))
        gen_ms = 1000 * (time.perf_counter() - t0) / args.rows
        kib = statistics.fmean(len(orjson.dumps(r)) for r in rows) / 1024
        m = await _bench_env(spec.name, rows, args.rollouts, args.concurrency)
        print(
            f"| {spec.name} | {gen_ms:.1f} | {kib:.1f} | {m['rollouts_per_s']:.0f} | {m['p50_ms']:.0f} | "
            f"{m['p99_ms']:.0f} | {m['calls_per_rollout']:.1f} | {m['mean_reward']:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
