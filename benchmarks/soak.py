"""Soak run (issue 42): does a long run hold flat? Memory, bytes written and time per step, start-up.

One process drives :class:`~gymbridge.run.recipe.GRPORun` step by step on the default smoke run
(the colour toy on the tiny random Qwen2-VL, the Gym path, artifacts and checkpoints on as by
default; no format warm-up: learning is not the point) over a generated dataset of ``--rows``
image rows (``data.path``: every row carries its PNG inline as base64). A callback samples, after
every step, the launcher's resident memory (``VmRSS``), the bytes this process passed to
``write()`` (``/proc/self/io`` ``wchar``: files and sockets; the loopback HTTP traffic is the
same every step) and the step's ``step_s``. After step ``--copy-at`` the run directory is copied
aside; at the end both it and the full run are resumed (set-up timed, then one step), so the
start-up of a resume is measured after a short and a long history.

Writes ``OUT/soak.json`` (per-step samples, start-up seconds, the flatness ratios) and, with
``--plot``, two charts (RSS and bytes written per step over the run).

    .venv/bin/python benchmarks/soak.py --steps 5000 --rows 200000 --out /tmp/soak \
        --plot docs/img/soak
"""

from __future__ import annotations

import argparse
import asyncio
import io
import shutil
import statistics
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from gymbridge.run.callbacks import Callback, default_callbacks
from gymbridge.run.config import load_run_config
from gymbridge.run.recipe import GRPORun
from gymbridge.run.userenv import resolve_env


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def wchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return 0


class _Null(io.TextIOBase):
    """The console's lines, dropped (a StringIO would grow with the run)."""

    def write(self, s: str) -> int:
        return len(s)


class Probe(Callback):
    """After every step: (step, RSS MB, wchar bytes since the previous step, step_s)."""

    def __init__(self) -> None:
        self.samples: list[tuple[int, float, int, float]] = []
        self._last = wchar()

    def on_step(self, report: Any, record: Mapping[str, Any]) -> None:
        now = wchar()
        self.samples.append((int(record["step"]), rss_mb(), now - self._last, float(record["step_s"])))
        self._last = now


def make_rows(path: Path, rows: int, seed: int) -> None:
    """``rows`` colour-toy rows with inline PNGs, written as they are generated."""
    if path.is_file() and sum(1 for _ in path.open("rb")) == rows:
        return
    spec = resolve_env("color_pick")
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as f:
        done = 0
        while done < rows:
            n = min(10_000, rows - done)
            for row in spec.generate(n, seed + done):
                f.write(orjson.dumps(row) + b"\n")
            done += n
            print(f"dataset: {done}/{rows} rows", file=sys.stderr, flush=True)
    tmp.replace(path)


def config(run_dir: Path, rows: Path, total_steps: int, sets: list[str]) -> Any:
    return load_run_config(
        ["smoke"],
        [
            ("steps", total_steps),
            ("data.path", str(rows)),
            ("warmup.steps", 0),
            ("output.run_dir", str(run_dir)),
            *sets,
        ],
    )


async def drive(cfg: Any, steps: int, copy_at: int, copy_to: Path) -> tuple[Probe, float, float]:
    """Run ``steps`` steps; returns the probe, the set-up seconds and the copy's seconds."""
    probe = Probe()
    started = time.perf_counter()
    copy_s = 0.0
    run = GRPORun(cfg, callbacks=[*default_callbacks(out=_Null(), artifacts=cfg.output.artifacts), probe])
    try:
        await run.setup()
        setup_s = time.perf_counter() - started
        for i in range(1, steps + 1):
            if await run.step() is None:
                raise RuntimeError(f"the data ran out at step {i}")
            if i == copy_at:
                t = time.perf_counter()
                await asyncio.sleep(0.5)  # the artifacts writer catches up; files are atomic anyway
                shutil.copytree(cfg.output.run_dir, copy_to, dirs_exist_ok=False)
                copy_s = time.perf_counter() - t
            if i % 250 == 0:
                s = probe.samples[-1]
                print(f"step {i}: rss {s[1]:.0f} MB, step_s {s[3]:.3f}", file=sys.stderr, flush=True)
        if run._checkpointed != steps:
            await run.save_checkpoint(steps)
    finally:
        await run.cleanup()
    return probe, setup_s, copy_s


async def resume(cfg: Any) -> dict[str, float]:
    """Set-up seconds of a resumed run, and its first step's."""
    started = time.perf_counter()
    run = GRPORun(
        cfg, callbacks=default_callbacks(out=_Null(), artifacts=cfg.output.artifacts), resume="must"
    )
    try:
        await run.setup()
        setup_s = time.perf_counter() - started
        t = time.perf_counter()
        await run.step()
        return {"setup_s": setup_s, "first_step_s": time.perf_counter() - t}
    finally:
        await run.cleanup()


def window(
    samples: list[tuple[int, float, int, float]], lo: int, hi: int
) -> list[tuple[int, float, int, float]]:
    return [s for s in samples if lo <= s[0] <= hi]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--window", type=int, default=500, help="steps compared at each end")
    ap.add_argument("--copy-at", type=int, default=500, help="copy the run dir aside after this step")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", dest="sets", action="append", default=[], help="KEY=VALUE config override")
    ap.add_argument("--plot", type=Path, default=None, help="write PREFIX_rss.png and PREFIX_bytes.png")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = args.out / "rows.jsonl"
    make_rows(rows, args.rows, args.seed)
    long_dir, short_dir = args.out / "run", args.out / f"run-at-{args.copy_at}"
    for d in (long_dir, short_dir):
        shutil.rmtree(d, ignore_errors=True)
    total = args.steps + 2  # room for one resumed step after the last
    probe, setup_s, copy_s = asyncio.run(
        drive(config(long_dir, rows, total, args.sets), args.steps, args.copy_at, short_dir)
    )
    resumed = {
        f"after_{args.copy_at}": asyncio.run(resume(config(short_dir, rows, total, args.sets))),
        f"after_{args.steps}": asyncio.run(resume(config(long_dir, rows, total, args.sets))),
    }
    s = probe.samples
    w = args.window
    first, last = window(s, 1, w), window(s, args.steps - w + 1, args.steps)
    # the step after the copy pays for it (it is not the run's own cost): left out of the windows
    first = [x for x in first if x[0] != args.copy_at + 1]
    rss_at = {x[0]: x[1] for x in s}
    result = {
        "command": " ".join(["benchmarks/soak.py", *sys.argv[1:]]),
        "steps": args.steps,
        "rows": args.rows,
        "dataset_bytes": rows.stat().st_size,
        "fresh_setup_s": setup_s,
        "copy_s": copy_s,
        "resume": resumed,
        "rss_mb": {
            "step_1": rss_at.get(1),
            f"step_{w}": rss_at.get(w),
            f"step_{args.steps}": rss_at.get(args.steps),
        },
        "rss_growth_mb": rss_at[args.steps] - rss_at[w],
        "bytes_per_step": {
            "first_mean": statistics.fmean(x[2] for x in first),
            "last_mean": statistics.fmean(x[2] for x in last),
        },
        "step_s_median": {
            "first": statistics.median(x[3] for x in first),
            "last": statistics.median(x[3] for x in last),
        },
        "run_dir_bytes": sum(p.stat().st_size for p in long_dir.rglob("*") if p.is_file()),
        "run_dir_files": sum(1 for p in long_dir.rglob("*") if p.is_file()),
        "samples": s,
    }
    b, t = result["bytes_per_step"], result["step_s_median"]
    result["bytes_ratio_last_first"] = b["last_mean"] / b["first_mean"]
    result["step_s_ratio_last_first"] = t["last"] / t["first"]
    (args.out / "soak.json").write_bytes(orjson.dumps(result))
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode())
    if args.plot is not None:
        plot(s, args.plot, w)


def plot(samples: list[tuple[int, float, int, float]], prefix: Path, w: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [x[0] for x in samples]
    prefix.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=100)
    ax.plot(steps, [x[1] for x in samples], lw=1)
    ax.set_title("launcher resident memory (MB) after each step")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(f"{prefix}_rss.png")
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=100)
    per = [x[2] / 1024 for x in samples]
    mean = [statistics.fmean(per[max(0, i - 49) : i + 1]) for i in range(len(per))]
    ax.plot(steps, per, lw=0.3, alpha=0.4, label="each step")
    ax.plot(steps, mean, lw=1.2, label="mean of 50 steps")
    ax.set_yscale("log")
    ax.set_title("KiB passed to write() per step (files and loopback sockets)")
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(f"{prefix}_bytes.png")
    plt.close(fig)


if __name__ == "__main__":
    main()
