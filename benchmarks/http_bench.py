"""Gym-over-HTTP overhead per rollout, without model time (issue 5 section 6).

A server process hosts a bare aiohttp echo endpoint and the full stack: the
SimpleAgent, a CounterEnv resources server and a ScriptedModelServer (each
rollout: seed -> model (tool call) -> tool -> model (answer) -> verify, i.e.
6 HTTP hops behind the client's one). The benchmark process drives it with
GymClient at each concurrency and, in the same run, the echo endpoint with
a bare aiohttp client (one round trip of the same row), so the ratio is measured under the same machine noise.

Usage::

    .venv/bin/python benchmarks/http_bench.py [--concurrency 1 32 256] [--rollouts 512]

Prints a table: rollouts/s, p50/p99 latency (ms), echo requests/s and p50/p99,
and rollout p50 / echo p50; plus peak RSS of both processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import time
from typing import Any


async def _serve() -> None:
    from aiohttp import web

    from gymbridge.server import SimpleAgent, start_server, tune_gc_for_serving
    from gymbridge.server.examples import CounterEnv
    from gymbridge.testing.scripted_model import ScriptedModelServer

    tune_gc_for_serving()  # this process is a server host, as under ``serve``

    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=await request.read(), content_type="application/json")

    app = web.Application()
    app.router.add_post("/echo", echo)
    echo_server = await start_server(app)
    env = await start_server(CounterEnv())
    model = ScriptedModelServer(
        [{"calls": [{"name": "increment", "arguments": {"amount": 1}}]}, "done"], keep_requests=False
    )
    await model.start()
    agent = await start_server(SimpleAgent(resources_url=env.url, model_url=model.url))
    print(json.dumps({"echo": echo_server.url, "agent": agent.url}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
    for server in (agent, env, echo_server):
        await server.stop()
    await model.stop()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"server_peak_rss_mib": usage.ru_maxrss / 1024}), flush=True)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def _echo_round(url: str, n: int, concurrency: int, row: dict[str, Any]) -> tuple[float, list[float]]:
    import aiohttp
    import orjson

    latencies: list[float] = []
    sem = asyncio.Semaphore(concurrency)
    body = orjson.dumps(row)
    connector = aiohttp.TCPConnector(limit=concurrency)
    deadline = aiohttp.ClientTimeout(total=60)  # every call has a deadline, the baseline too
    async with aiohttp.ClientSession(connector=connector, timeout=deadline) as client:

        async def one() -> None:
            async with sem:
                t = time.perf_counter()
                async with client.post(url + "/echo", data=body) as r:
                    r.raise_for_status()
                    await r.read()
                latencies.append(time.perf_counter() - t)

        started = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        return n / (time.perf_counter() - started), latencies


async def _bench(urls: dict[str, str], concurrencies: list[int], rollouts: int) -> list[dict[str, Any]]:
    from gymbridge.client import GymClient
    from gymbridge.server.examples import counter_rows

    rows_template = counter_rows(1)[0]
    table = []
    for conc in concurrencies:
        n = max(rollouts, 2 * conc) if conc > 1 else min(rollouts, 200)
        rows = counter_rows(n, seed=conc)
        async with GymClient(urls["agent"], max_connections=max(conc, 1), deadline_s=300) as client:
            # warm-up: open connections, fill caches
            async for _ in client.run_many(rows[: min(conc, 32)], concurrency=conc, progress=False):
                pass
            started = time.perf_counter()
            outcomes = [o async for o in client.run_many(rows, concurrency=conc, progress=False)]
            rps = n / (time.perf_counter() - started)
        failed = sum(1 for o in outcomes if not o.ok)
        lat = [o.elapsed_s for o in outcomes]
        echo_rps, echo_lat = await _echo_round(urls["echo"], n, conc, rows_template)
        table.append(
            {
                "concurrency": conc,
                "rollouts": n,
                "failed": failed,
                "rollouts_per_s": rps,
                "p50_ms": _pct(lat, 0.5),
                "p99_ms": _pct(lat, 0.99),
                "echo_per_s": echo_rps,
                "echo_p50_ms": _pct(echo_lat, 0.5),
                "echo_p99_ms": _pct(echo_lat, 0.99),
                "ratio_p50": _pct(lat, 0.5) / max(_pct(echo_lat, 0.5), 1e-9),
            }
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--rollouts", type=int, default=512)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(_serve())
        return
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        urls = json.loads(proc.stdout.readline())
        table = asyncio.run(_bench(urls, args.concurrency, args.rollouts))
    finally:
        proc.stdin.close()
        tail = proc.stdout.read()
        proc.wait(timeout=30)
    lines = tail.strip().splitlines()
    server_rss = json.loads(lines[-1]).get("server_peak_rss_mib") if lines else None
    header = (
        f"{'conc':>5} {'n':>5} {'fail':>4} {'rollouts/s':>10} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'echo/s':>8} {'echo p50':>8} {'echo p99':>8} {'p50 ratio':>9}"
    )
    print(header)
    for r in table:
        print(
            f"{r['concurrency']:>5} {r['rollouts']:>5} {r['failed']:>4} {r['rollouts_per_s']:>10.1f} "
            f"{r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} {r['echo_per_s']:>8.1f} {r['echo_p50_ms']:>8.2f} "
            f"{r['echo_p99_ms']:>8.2f} {r['ratio_p50']:>9.1f}"
        )
    client_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS: client {client_rss:.0f} MiB, servers {server_rss:.0f} MiB" if server_rss else "")
    print("(rollout = 1 client hop + 6 hops behind the agent: seed, 2x model, tool, verify; no model time)")


if __name__ == "__main__":
    main()
