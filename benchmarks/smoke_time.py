"""How long the default smoke takes, against its goal (3 minutes); the learning test checks learning only.

    .venv/bin/python benchmarks/smoke_time.py [--gym] [--busy-core]

Runs ``gymbridge smoke run --native`` in a fresh process (``python -m gymbridge.cli``): what
tests/run/test_learning.py runs, the shipped default config with rollouts in
process and one torch thread. ``--gym`` also times the Gym path (``gymbridge smoke run``: env,
agent and model servers on loopback). ``--busy-core`` keeps one core busy with a spinning process
for the whole run, like a loaded CI machine. Prints one row per run: wall seconds, the goal,
and the last 10 steps' mean env reward.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL_S = 180.0


def run(native: bool, run_dir: Path) -> tuple[float, float]:
    cmd = [sys.executable, "-m", "gymbridge.cli", "smoke", "run", "--no-progress", "--run-dir", str(run_dir)]
    if native:
        cmd.append("--native")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    started = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    wall_s = time.perf_counter() - started
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    last = [float(r["env_reward_mean"]) for r in records[-10:]]
    return wall_s, sum(last) / len(last)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gym", action="store_true", help="also time the Gym path (servers on loopback)")
    parser.add_argument("--busy-core", action="store_true", help="keep one core busy meanwhile")
    args = parser.parse_args()
    spinner = None
    if args.busy_core:
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for native in [True, False] if args.gym else [True]:
                name = "native" if native else "gym"
                wall_s, reward = run(native, Path(tmp) / name)
                rows.append((f"gymbridge smoke run{' --native' if native else ''}", wall_s, reward))
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    load = "one core busy" if args.busy_core else "nothing else started"
    print(f"{'run (' + load + ')':<40} {'wall s':>8} {'goal s':>7} {'last-10 reward':>15}")
    for name, wall_s, reward in rows:
        print(f"{name:<40} {wall_s:8.1f} {GOAL_S:7.0f} {reward:15.3f}")


if __name__ == "__main__":
    main()
