"""A generator fleet on this machine: throughput, publication and failover, side by side in one run.

Three measurements, each comparing columns measured in the same process, interleaved round by
round so that load from other jobs hits every column alike:

* **generation**: rollouts per second through the fleet's router with 1 replica and with 2
  (``gymbridge model serve --tiny`` children, each at one thread: ``OMP_NUM_THREADS=1``, one call
  at a time: ``--max-batch-size 1``), for
  ``--calls`` concurrent single-turn ``/v1/responses`` calls of ``--max-tokens`` tokens each (the
  smoke environment's one model call per rollout); the model server is the bottleneck;
* **publication**: :class:`gymbridge.run.fleet.FleetPublisher` publishing the run's tiny policy to
  1 replica and to 2, through shared memory (written once, swapped by each replica) and over the
  broadcast (a weight group per replica), beside today's one-child
  :class:`~gymbridge.trainer.weight_sync.DistributedPublisher`;
* **failover**: a ``gymbridge smoke run`` with ``generator.replicas=2`` in which replica 0 is killed
  with SIGKILL while it has calls in flight: the steps done, the calls moved, the rollouts failed,
  the seconds until the replica served again, and the drift guard's ``ratio_mean`` at every step.

Not part of the test suite.

    .venv/bin/python benchmarks/fleet.py [--rounds 5] [--calls 32] [--max-tokens 16] [--max-batch-size 1]
        [--syncs 10] [--steps 8] [--parts generation,publication,failover]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import secrets
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


MAX_BATCH_SIZE = 1
"""Calls one model server generates together (``--max-batch-size``; set from the command line)."""


def _command(enable_weight_updates: bool, max_tokens: int) -> list[str]:
    from gymbridge.run.generator_process import tiny_server_command

    command = tiny_server_command(
        seed=0,
        max_model_len=2048,
        default_max_tokens=max_tokens,
        prompt_seed=0,
        enable_weight_updates=enable_weight_updates,
    )
    return [*command, "--max-batch-size", str(MAX_BATCH_SIZE)]


async def _fleet(
    stack: contextlib.AsyncExitStack, size: int, log_dir: Path, *, secret: str | None, max_tokens: int
) -> Any:
    from gymbridge.generation.server import WEIGHTS_SECRET_ENV
    from gymbridge.run.fleet import FleetManager

    env = {**ONE_THREAD, **({WEIGHTS_SECRET_ENV: secret} if secret else {})}
    manager = FleetManager(
        [_command(secret is not None, max_tokens)] * size,
        [dict(env) for _ in range(size)],
        log_dir=log_dir,
        publish=False,  # routed at once: these fleets are not published to by a trainer here
    )
    stack.push_async_callback(manager.aclose)
    await manager.start()
    return manager


async def _rollouts_per_s(url: str, calls: int, max_tokens: int) -> float:
    import aiohttp

    body = {
        "input": [{"role": "user", "content": "Name a colour, then say why you like it."}],
        "max_output_tokens": max_tokens,
        "temperature": 1.0,
    }
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:

        async def one(i: int) -> None:
            async with http.post(f"{url}/v1/responses", json={**body, "seed": i}) as reply:
                await reply.read()
                if reply.status != 200:
                    raise RuntimeError(f"HTTP {reply.status}: {await reply.text()}")

        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(calls)))
        return calls / (time.perf_counter() - started)


async def generation(rounds: int, calls: int, max_tokens: int, log_dir: Path) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {1: [], 2: []}
    async with contextlib.AsyncExitStack() as stack:
        fleets = {
            n: await _fleet(stack, n, log_dir / f"gen{n}", secret=None, max_tokens=max_tokens) for n in (1, 2)
        }
        for fleet in fleets.values():  # warm-up: first calls load kernels, caches
            await _rollouts_per_s(fleet.router.url, 4, max_tokens)
        for _ in range(rounds):
            for n, fleet in fleets.items():
                out[n].append(await _rollouts_per_s(fleet.router.url, calls, max_tokens))
    return out


async def publication(rounds: int, syncs: int, log_dir: Path) -> dict[str, list[float]]:
    from gymbridge.run.fleet import FleetPublisher
    from gymbridge.trainer import tiny_policy
    from gymbridge.trainer.weight_sync import DistributedPublisher

    model = tiny_policy(0)
    secret = secrets.token_urlsafe(32)
    out: dict[str, list[float]] = {}
    async with contextlib.AsyncExitStack() as stack:
        pubs: dict[str, Any] = {}
        for transport in ("shared_memory", "broadcast"):
            single = await _fleet(stack, 1, log_dir / f"one-{transport}", secret=secret, max_tokens=16)
            pub = DistributedPublisher(single.router.replicas[0].url, transport=transport, secret=secret)
            stack.callback(pub.close)
            pubs[f"{transport}: one child (today)"] = pub
            for n in (1, 2):
                fleet = await _fleet(stack, n, log_dir / f"pub{n}-{transport}", secret=secret, max_tokens=16)
                fp = FleetPublisher(
                    [r.url for r in fleet.router.replicas], transport=transport, secret=secret
                )
                stack.callback(fp.close)
                pubs[f"{transport}: fleet of {n}"] = fp
        version = 0
        for pub in pubs.values():  # version 0 connects (segments, groups); not timed
            await asyncio.to_thread(pub.publish, model, version)
        for _ in range(rounds):
            version += 1
            for name, pub in pubs.items():
                seconds = [
                    await asyncio.to_thread(pub.publish, model, version * syncs + k) for k in range(syncs)
                ]
                out.setdefault(name, []).append(statistics.median(seconds))
    return out


def failover(steps: int, run_dir: Path) -> dict[str, Any]:
    from gymbridge.run import load_run_config, train
    from gymbridge.run.callbacks import Callback, default_callbacks

    facts: dict[str, Any] = {}

    class Kill(Callback):
        fleet: Any = None

        def on_setup(self, run: Any) -> None:
            self.fleet = run.services.generator.fleet

        def on_step(self, report: Any, record: Any) -> None:
            if report.step == 1:
                threading.Thread(target=self.kill, daemon=True).start()
            if report.step == 3:  # the run goes on meanwhile; here it waits for replica 0 to be back
                replica = self.fleet.router.replicas[0]
                while time.monotonic() - facts["killed_at"] < 120 and not (
                    replica.restarts and replica.state.value == "HEALTHY"
                ):
                    time.sleep(0.02)
                facts["back_after_s"] = time.monotonic() - facts["killed_at"]

        def kill(self) -> None:
            replica = self.fleet.router.replicas[0]
            while not replica.in_flight:
                time.sleep(0.002)
            facts["in_flight_at_kill"] = replica.in_flight
            facts["killed_at"] = time.monotonic()
            os.killpg(self.fleet.children[0].pid, signal.SIGKILL)

    settings = [
        ("steps", steps),
        ("bridge.prompts_per_step", 2),
        ("bridge.group_size", 4),
        ("rollout.max_tokens", 16),
        ("warmup.steps", 0),
        ("shaping.kind", "token_rate"),
        ("generator.placement", "process"),
        ("generator.replicas", 2),
        ("generator.restart_backoff_s", 0.2),
        ("output.run_dir", str(run_dir)),
    ]
    out = io.StringIO()
    started = time.perf_counter()
    summary = train(
        load_run_config(["smoke"], settings),
        out=out,
        callbacks=[*default_callbacks(out=out, artifacts=False), Kill()],
    )
    facts["wall_s"] = time.perf_counter() - started
    import json

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    facts["steps"] = len(records)
    facts["rollouts_ok"] = summary.rollouts_ok
    facts["rollouts_failed"] = summary.rollouts_failed
    facts["calls_moved"] = sum(r.get("generator/replica_0/retried", 0) for r in records)
    facts["ratio_dev_max"] = max(abs(r["ratio_mean"] - 1.0) for r in records if r.get("skipped") is None)
    facts["replica_0"] = [
        (
            r["step"],
            r["generator/replica_0/state"],
            r["generator/replica_0/requests"],
            r["generator/replica_0/policy_version"],
        )
        for r in records
    ]
    facts["policy_versions"] = [r["policy_version"] for r in records]
    return facts


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=32, help="concurrent rollouts per round")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--syncs", type=int, default=10, help="publications per round and column")
    parser.add_argument("--steps", type=int, default=8, help="steps of the failover run")
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=1,
        help="calls a model server generates together (1: one at a time, so generation is the bottleneck)",
    )
    parser.add_argument("--parts", default="generation,publication,failover")
    args = parser.parse_args()
    global MAX_BATCH_SIZE
    MAX_BATCH_SIZE = args.max_batch_size
    parts = set(args.parts.split(","))
    import logging

    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="gb-fleet-bench-") as tmp:
        root = Path(tmp)
        if "generation" in parts:
            gen = asyncio.run(generation(args.rounds, args.calls, args.max_tokens, root))
            one, two = statistics.median(gen[1]), statistics.median(gen[2])
            print(
                f"\ngeneration: {args.calls} concurrent rollouts x {args.max_tokens} tokens, tiny model, "
                f"one thread per server, --max-batch-size {args.max_batch_size}"
            )
            print(f"{'replicas':<34} {'rollouts/s (median of ' + str(args.rounds) + ')':>28}")
            print(f"{'1':<34} {one:>28.2f}")
            print(f"{'2':<34} {two:>28.2f}")
            print(f"{'2 / 1':<34} {two / one:>27.2f}x")
        if "publication" in parts:
            pub = asyncio.run(publication(args.rounds, args.syncs, root))
            print(
                f"\npublication of the tiny policy: median of {args.rounds} rounds x {args.syncs} syncs, ms"
            )
            for name, values in pub.items():
                print(f"{name:<44} {1000 * statistics.median(values):>8.2f}")
            for transport in ("shared_memory", "broadcast"):
                ratio = statistics.median(pub[f"{transport}: fleet of 2"]) / statistics.median(
                    pub[f"{transport}: fleet of 1"]
                )
                print(f"{transport + ': fleet of 2 / fleet of 1':<44} {ratio:>7.2f}x")
        if "failover" not in parts:
            return
        facts = failover(args.steps, root / "failover")
        print("\nfailover: smoke run, generator.replicas=2, replica 0 killed (SIGKILL) with calls in flight")
        for key in (
            "steps",
            "wall_s",
            "in_flight_at_kill",
            "calls_moved",
            "rollouts_ok",
            "rollouts_failed",
            "back_after_s",
            "ratio_dev_max",
            "policy_versions",
            "replica_0",
        ):
            value = facts.get(key)
            shown = (
                f"{value:.3e}"
                if key == "ratio_dev_max"
                else f"{value:.3g}"
                if isinstance(value, float)
                else str(value)
            )
            print(f"{key:<20} {shown}")


if __name__ == "__main__":
    main()
