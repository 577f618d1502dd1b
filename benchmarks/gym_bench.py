"""Side-by-side throughput of gymbridge's stack vs the genuine NeMo Gym 0.7.0 stack, on loopback.

Role: the issue-6 benchmark. Both stacks run the same rollout against ONE shared scripted model
server (gymbridge's ``ScriptedModelServer`` in its own process):

* ours:    gymbridge ``SimpleAgent``       + gymbridge ``environments/counter``
* genuine: genuine ``simple_agent`` (0.7.0) + genuine ``example_session_state_mgmt``

The scripted model runs with ``keep_requests=False`` (its default keeps every request body, so its
heap, and its per-call cost, would grow through the run and tax the later, higher-concurrency
levels of both stacks).

Each rollout: ``/seed_session``, model call 1 (``increment_counter(count=1)``), one tool call,
model call 2 (a final message), ``/verify``. Every server is its own process (single worker), the
driver is one neutral aiohttp client in this process posting ``/run`` with at most ``C`` in flight.
A rollout counts as a failure unless it answers HTTP 200 with ``reward == 1.0``.

Reported per stack and concurrency: rollouts/s, p50 and p99 latency (s), failures, and the ratio
ours/genuine measured in the same run (these machines are noisy: compare ratios, not absolutes).
Stacks are interleaved per concurrency level (genuine then ours) so drift hits both alike.

Run (needs ``.venv-gym``: ``bash scripts/setup_gym_venv.sh``)::

    .venv/bin/python benchmarks/gym_bench.py                  # C = 1, 32, 256
    .venv/bin/python benchmarks/gym_bench.py --quick          # fewer rollouts per level
    .venv/bin/python benchmarks/gym_bench.py --json out.json  # also write the numbers
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "gym"))
sys.path.insert(0, str(REPO))

from _genuine import (  # noqa: E402  (the launcher lives with the gym suite)
    KIND_RESOURCES,
    GenuineStack,
    child_env,
    free_port,
    gym_venv_problem,
)
from _gym_support import add_genuine_simple_agent, add_scripted_model  # noqa: E402

SCRIPT = [{"calls": [{"name": "increment_counter", "arguments": {"count": 1}}]}, "The count is updated."]
TOOLS = json.loads((REPO / "tests" / "gym" / "recorded" / "rows" / "counter_tools.json").read_text())
GYMBRIDGE_PY = REPO / ".venv" / "bin" / "python"

OURS_ENV = """
import logging, sys
from gymbridge_envs.counter.server import CounterServer
from gymbridge.server import serve
logging.basicConfig(level=logging.WARNING)
serve(CounterServer(instance_name="bench_counter"), port=int(sys.argv[1]))
"""
MODEL = """
import json, logging, sys
from gymbridge.server import serve
from gymbridge.testing.scripted_model import ScriptedModelServer
logging.basicConfig(level=logging.WARNING)
# a benchmark must not keep every request body: the heap would grow per level
server = ScriptedModelServer(json.loads(open(sys.argv[2]).read()), keep_requests=False)
serve(server, port=int(sys.argv[1]))
"""
OURS_AGENT = """
import logging, sys
from gymbridge.server import SimpleAgent, serve
logging.basicConfig(level=logging.WARNING)
agent = SimpleAgent(resources_url=sys.argv[2], model_url=sys.argv[3], instance_name="bench_agent")
serve(agent, port=int(sys.argv[1]))
"""


@dataclass
class Level:
    stack: str
    concurrency: int
    rollouts: int
    seconds: float
    rollouts_per_s: float
    p50_s: float
    p99_s: float
    failures: int


def row(i: int) -> dict[str, Any]:
    initial = i % 50
    return {
        "responses_create_params": {
            "input": [{"role": "user", "content": "add 1 then stop"}],
            "tools": TOOLS,
        },
        "initial_count": initial,
        "expected_count": initial + 1,
    }


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


async def drive(url: str, n: int, concurrency: int, timeout_s: float) -> tuple[float, list[float], int]:
    """Post ``n`` rollouts to ``url``/run with at most ``concurrency`` in flight."""
    latencies: list[float] = []
    failures = 0
    next_index = 0
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker() -> None:
            nonlocal next_index, failures
            while next_index < n:
                i = next_index
                next_index += 1
                t0 = time.perf_counter()
                try:
                    async with session.post(f"{url}/run", json=row(i)) as resp:
                        body = await resp.read()
                        ok = resp.status == 200 and json.loads(body).get("reward") == 1.0
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    ok = False
                latencies.append(time.perf_counter() - t0)
                failures += not ok

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started, latencies, failures


def measure(stack: str, url: str, n: int, concurrency: int, timeout_s: float) -> Level:
    asyncio.run(drive(url, min(n, max(16, concurrency)), concurrency, timeout_s))  # warm-up
    seconds, latencies, failures = asyncio.run(drive(url, n, concurrency, timeout_s))
    return Level(
        stack=stack,
        concurrency=concurrency,
        rollouts=n,
        seconds=round(seconds, 3),
        rollouts_per_s=round(n / seconds, 1),
        p50_s=round(statistics.median(latencies), 4),
        p99_s=round(percentile(latencies, 0.99), 4),
        failures=failures,
    )


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/", timeout=1.0, trust_env=False).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url}: not ready after {timeout_s:.0f} s")


def start_ours(workdir: Path, env: dict[str, str]) -> tuple[list[subprocess.Popen[bytes]], dict[str, str]]:
    procs: list[subprocess.Popen[bytes]] = []
    script = workdir / "script.json"
    script.write_text(json.dumps(SCRIPT))
    ports = {name: free_port() for name in ("model", "env", "agent")}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    commands = {
        "model": [str(GYMBRIDGE_PY), "-c", MODEL, str(ports["model"]), str(script)],
        "env": [str(GYMBRIDGE_PY), "-c", OURS_ENV, str(ports["env"])],
        "agent": [str(GYMBRIDGE_PY), "-c", OURS_AGENT, str(ports["agent"]), urls["env"], urls["model"]],
    }
    try:
        for name, cmd in commands.items():
            with (workdir / f"ours_{name}.log").open("wb") as log:
                proc = subprocess.Popen(
                    cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            procs.append(proc)
            wait_http(urls[name], proc)
    except BaseException:
        stop_all(procs)  # the ones already up must not outlive a failed start
        raise
    return procs, urls


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each server's process group, SIGKILL what is still there after 10 s."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--rollouts", type=int, default=0, help="rollouts per level (default: by level)")
    parser.add_argument("--quick", action="store_true", help="fewer rollouts per level (smoke run)")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="per-rollout client deadline")
    parser.add_argument("--stacks", nargs="+", default=["genuine", "ours"], choices=["genuine", "ours"])
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

    if "genuine" in args.stacks and (problem := gym_venv_problem()):
        print(f"cannot run the genuine stack: {problem}", file=sys.stderr)
        return 2

    workdir = Path(tempfile.mkdtemp(prefix="gym-bench-"))
    env = child_env(workdir / "tmp")
    env["PYTHONPATH"] = str(REPO)
    try:
        procs, urls = start_ours(workdir, env)
    except BaseException:
        print(f"our servers did not start; logs kept in {workdir}", file=sys.stderr)
        raise
    stack = GenuineStack(workdir / "genuine")
    add_scripted_model(stack, urls["model"])
    stack.add("counter", KIND_RESOURCES, "example_session_state_mgmt", domain="agent")
    add_genuine_simple_agent(stack, "counter_agent", "counter")
    results: list[Level] = []
    try:
        if "genuine" in args.stacks:
            stack.start()
        targets = {"genuine": stack.url("counter_agent"), "ours": urls["agent"]}
        for c in args.concurrency:
            n = args.rollouts or (max(64, 2 * c) if args.quick else {1: 300}.get(c, max(600, 4 * c)))
            for name in args.stacks:
                level = measure(name, targets[name], n, c, args.timeout_s)
                results.append(level)
                print(
                    f"{name:>8} C={c:<4} {level.rollouts_per_s:8.1f} rollouts/s  p50 {level.p50_s:7.3f} s  "
                    f"p99 {level.p99_s:7.3f} s  failures {level.failures}/{n}",
                    flush=True,
                )
    except BaseException:
        print(f"benchmark failed; server logs kept in {workdir}", file=sys.stderr)
        raise
    finally:
        stack.stop()
        stop_all(procs)
    shutil.rmtree(workdir, ignore_errors=True)  # no temp folder left behind by a good run

    print_table(results)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")
    return 0


def print_table(results: list[Level]) -> None:
    """The README table (markdown), one line per concurrency level."""
    by = {(r.stack, r.concurrency): r for r in results}

    def cell(level: Level | None, text: str) -> str:
        return text if level is not None else "-"

    print()
    print(
        "| concurrency | genuine rollouts/s | ours rollouts/s | ours/genuine "
        "| genuine p50 / p99 (s) | ours p50 / p99 (s) | failures genuine / ours |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for c in sorted({r.concurrency for r in results}):
        g, o = by.get(("genuine", c)), by.get(("ours", c))
        ratio = f"{o.rollouts_per_s / g.rollouts_per_s:.1f}x" if g and o and g.rollouts_per_s else "-"
        cells = [
            str(c),
            cell(g, f"{g.rollouts_per_s}" if g else ""),
            cell(o, f"{o.rollouts_per_s}" if o else ""),
            ratio,
            cell(g, f"{g.p50_s:.3f} / {g.p99_s:.3f}" if g else ""),
            cell(o, f"{o.p50_s:.3f} / {o.p99_s:.3f}" if o else ""),
            f"{g.failures if g else '-'} / {o.failures if o else '-'}",
        ]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
