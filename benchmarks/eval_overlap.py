"""Validation beside the loop (issue 41): what a pass costs the training loop.

Runs the smoke run (the colour toy on the tiny random Qwen2-VL, Gym path, no warm-up,
``trainer.kl_coef`` so every step trains and publishes) ``--repeats`` times each, alternating,
without validation and with ``eval.every=--every`` (``--prompts`` prompts x ``--n`` samples), and
reports per variant the median ``step_s`` and the run's wall seconds, and for the validated runs
each pass's ``elapsed_s`` beside the ``eval_wait_s`` of the step after it: the part of a pass the
loop waited for; the rest ran while the next batch's rollouts and update did.

    .venv/bin/python benchmarks/eval_overlap.py --steps 30 --every 5 --repeats 3
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from gymbridge.run.config import load_run_config
from gymbridge.run.recipe import train
from gymbridge.run.rundir import RunDir


def _run(root: Path, name: str, settings: dict[str, Any]) -> tuple[float, RunDir]:
    cfg = load_run_config(["smoke"], [*settings.items(), ("output.run_dir", str(root / name))])
    started = time.perf_counter()
    train(cfg, out=io.StringIO())
    return time.perf_counter() - started, RunDir(root / name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    base = {
        "steps": args.steps,
        "warmup.steps": 0,
        "trainer.kl_coef": 0.01,
        "output.artifacts": False,
        "output.export": "none",
        "checkpoint.every": 0,
    }
    validated = {
        **base,
        "eval.every": args.every,
        "eval.at_end": False,
        "eval.n": args.n,
        "eval.max_prompts": args.prompts,
    }
    rows: dict[str, list[float]] = {"off": [], "on": []}
    steps: dict[str, list[float]] = {"off": [], "on": []}
    passes: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for r in range(args.repeats):
            for name, settings in (("off", base), ("on", validated)):
                wall, run = _run(root, f"{name}{r}", settings)
                rows[name].append(wall)
                records = run.metrics()
                steps[name] += [float(rec["step_s"]) for rec in records]
                if name == "on":
                    wait = {int(rec["step"]): float(rec["eval_wait_s"]) for rec in records}
                    for p in run.iter_eval():
                        # a pass after step s is waited for by the publication of step s + 1
                        if p["step"] + 1 in wait:
                            passes.append((float(p["elapsed_s"]), wait[p["step"] + 1]))
    for name in ("off", "on"):
        print(
            f"eval {name:3}: run wall median {statistics.median(rows[name]):.2f}s "
            f"(max {max(rows[name]):.2f}s), step_s median {statistics.median(steps[name]):.3f}s"
        )
    print(
        f"wall on/off (median of {args.repeats}): "
        f"{statistics.median(rows['on']) / statistics.median(rows['off']):.3f}x"
    )
    elapsed = [e for e, _ in passes]
    waited = [w for _, w in passes]
    hidden = [1 - w / e for e, w in passes if e > 0]
    print(
        f"{len(passes)} passes ({args.prompts} prompts x {args.n}): elapsed median "
        f"{statistics.median(elapsed):.3f}s "
        f"(max {max(elapsed):.3f}s); the loop waited median {statistics.median(waited):.3f}s "
        f"(max {max(waited):.3f}s); share of a pass overlapped with training: median "
        f"{statistics.median(hidden):.2f}, worst {min(hidden):.2f}"
    )


if __name__ == "__main__":
    main()
