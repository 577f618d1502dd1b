"""Does the main job learn on every seed, thread count and load? A table of whole runs.

    .venv/bin/python benchmarks/learning_robustness.py                      # the default (Gym path)
    .venv/bin/python benchmarks/learning_robustness.py --config smoke_native --seeds 0-9
    .venv/bin/python benchmarks/learning_robustness.py --config smoke_color_tool --threads 1
    .venv/bin/python benchmarks/learning_robustness.py --set trainer.kl_coef=0.05   # a candidate

Each run is exactly ``gymbridge smoke run --no-progress --seed S [--config C] [--set ...]`` in a
process of its own, with ``OMP_NUM_THREADS`` unset (the machine's default threads) or set to 1;
``--parallel`` runs go at once (2 by default: the load a user's machine has while something else
runs). For every run it prints the env reward of the first 3 steps and the mean of the last 10
(from the run's ``metrics.jsonl``), the steps the optimizer skipped (no reward variance) and the
wall time, then how many runs ended at >= 0.9 and the worst one. ``--json FILE`` keeps the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

GYMBRIDGE = Path(sys.executable).with_name("gymbridge")


@dataclass
class Row:
    seed: int
    threads: str
    first3: list[float]
    last10: float
    skipped: int
    steps: int
    wall_s: float
    ok: bool
    error: str = ""


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def run_one(seed: int, threads: str, args: argparse.Namespace, root: Path) -> Row:
    run_dir = root / f"{args.label}-s{seed}-t{threads}"
    cmd = [str(GYMBRIDGE), "smoke", "run", "--no-progress", "--seed", str(seed), "--run-dir", str(run_dir)]
    if args.config:
        cmd += ["--config", args.config]
    for setting in args.set:
        cmd += ["--set", setting]
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if threads != "default":
        env["OMP_NUM_THREADS"] = threads
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - started
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    rewards = [float(r["env_reward_mean"]) for r in records]
    if proc.returncode != 0 or not rewards:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return Row(seed, threads, [], 0.0, 0, len(rewards), wall, False, tail[0][:200])
    last = rewards[-10:]
    return Row(
        seed,
        threads,
        rewards[:3],
        sum(last) / len(last),
        sum(1 for r in records if r.get("skipped")),
        len(rewards),
        wall,
        True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--config", default=None, help="a shipped overlay (default: smoke)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to the run")
    parser.add_argument("--seeds", default="0-9", help="e.g. 0-9 or 0,3,5")
    parser.add_argument("--threads", nargs="+", default=["default", "1"], help="'default' and/or counts")
    parser.add_argument("--parallel", type=int, default=2, help="runs at once")
    parser.add_argument("--label", default="run", help="name prefix of the run directories")
    parser.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    parser.add_argument("--json", type=Path, default=None, help="write the rows to this file")
    parser.add_argument(
        "--goal", type=float, default=0.9, help="a run learned if its last-10 mean is >= this"
    )
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="gymbridge-robustness-"))
    root.mkdir(parents=True, exist_ok=True)
    jobs = [(s, t) for t in args.threads for s in _seeds(args.seeds)]
    print(
        f"{len(jobs)} runs, {args.parallel} at a time: smoke run --config {args.config or 'smoke'} {args.set}"
    )
    print(f"{'seed':>4} {'threads':>7}  {'first 3 steps':<20} {'last 10':>7} {'skipped':>7} {'wall s':>7}")
    rows: list[Row] = []
    with ThreadPoolExecutor(args.parallel) as pool:
        futures = [pool.submit(run_one, s, t, args, root) for s, t in jobs]
        for future in futures:
            row = future.result()
            rows.append(row)
            first = " ".join(f"{x:.3f}" for x in row.first3) if row.ok else f"FAILED: {row.error}"
            numbers = f"{row.last10:>7.3f} {row.skipped:>7} {row.wall_s:>7.0f}"
            print(f"{row.seed:>4} {row.threads:>7}  {first:<20} {numbers}", flush=True)
    done = [r for r in rows if r.ok]
    learned = [r for r in done if r.last10 >= args.goal]
    worst = min(done, key=lambda r: r.last10) if done else None
    print(
        f"\nlearned (last 10 >= {args.goal}): {len(learned)} of {len(rows)}; "
        + (f"worst: seed {worst.seed}, threads {worst.threads}: {worst.last10:.3f}; " if worst else "")
        + f"wall {min(r.wall_s for r in rows):.0f}-{max(r.wall_s for r in rows):.0f} s"
    )
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
