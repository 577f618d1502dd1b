"""``gymbridge collect``: roll a dataset out through any NeMo Gym agent, as ``ng_collect_rollouts`` does.

``gymbridge collect --agent-url URL --dataset rows.jsonl --out results.jsonl [-n 4]`` sends every
row ``n`` times to ``POST URL/run`` (:meth:`gymbridge.client.GymClient.run_many`: our deadlines,
retries of transport failures, a progress bar with the mean reward) and writes

* ``OUT``: one line per successful rollout, the agent's result (row echo + ``response`` +
  ``reward``) plus ``gymbridge: {task_index, rollout_index, attempts, elapsed_s}``;
* ``OUT`` with ``.failures.jsonl`` in place of ``.jsonl`` (or ``--failures PATH``): one record per
  failed rollout (:meth:`~gymbridge.client.RolloutOutcome.failure_record` plus ``task_index`` /
  ``rollout_index``) and per dataset line that is not a JSON object.

Invariants: every (row, repeat) ends as exactly one line in one of the two files; both files
are written from scratch by each run and appended to (one whole line per write, flushed) as
outcomes arrive, so a run stopped early leaves whole lines only. Nothing is lost by mistake:
``--out`` or the failures file naming the dataset (or each other) is refused before anything is
opened, and so are earlier results at either path unless ``--overwrite`` is given.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson

from gymbridge.errors import ConfigError

__all__ = ["CollectSummary", "add_collect_arguments", "collect"]


@dataclass(frozen=True)
class CollectSummary:
    rollouts_ok: int
    rollouts_failed: int
    bad_rows: int
    mean_reward: float | None
    results_path: Path
    failures_path: Path


def _failures_path(out: Path) -> Path:
    name = out.name.removesuffix(".jsonl")
    return out.with_name(f"{name}.failures.jsonl")


def _write(f: IO[bytes], record: dict[str, Any]) -> None:
    f.write(orjson.dumps(record, default=str) + b"\n")
    f.flush()


def collect(
    agent_url: str,
    dataset: Path,
    out: Path,
    *,
    repeats: int = 1,
    concurrency: int = 32,
    deadline_s: float = 900.0,
    failures: Path | None = None,
    progress: bool = True,
    overwrite: bool = False,
) -> CollectSummary:
    """Run every row of ``dataset`` ``repeats`` times through the agent at ``agent_url``; see the module.

    ``overwrite``: replace earlier results at ``out`` and the failures file (else refused).
    """
    if repeats < 1:
        raise ConfigError([f"-n must be >= 1, got {repeats}"])
    if not dataset.is_file():
        raise ConfigError([f"--dataset {dataset}: no such file"])
    failures = failures if failures is not None else _failures_path(out)
    _check_paths(dataset, out, failures, overwrite=overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    failures.parent.mkdir(parents=True, exist_ok=True)
    with out.open("wb") as results_f, failures.open("wb") as failures_f:
        ok, failed, bad, rewards = asyncio.run(
            _collect(agent_url, dataset, results_f, failures_f, repeats, concurrency, deadline_s, progress)
        )
    mean = sum(rewards) / len(rewards) if rewards else None
    return CollectSummary(ok, failed, bad, mean, out, failures)


def _same(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve() or (a.exists() and b.exists() and a.samefile(b))


def _check_paths(dataset: Path, out: Path, failures: Path, *, overwrite: bool) -> None:
    """Refuse output paths that would empty the dataset or each other, or earlier results (module)."""
    problems = []
    for flag, path in (("--out", out), ("--failures", failures)):
        if _same(path, dataset):
            problems.append(f"{flag} {path} is the dataset: writing it would empty it before it is read")
    if _same(out, failures):
        problems.append(f"--out and --failures are the same file ({out})")
    if not overwrite:
        for flag, path in (("--out", out), ("--failures", failures)):
            if path.is_file() and path.stat().st_size and not _same(path, dataset):
                problems.append(f"{flag} {path} holds earlier results; pass --overwrite to replace them")
    if problems:
        raise ConfigError(problems)


async def _collect(
    agent_url: str,
    dataset: Path,
    results_f: IO[bytes],
    failures_f: IO[bytes],
    repeats: int,
    concurrency: int,
    deadline_s: float,
    progress: bool,
) -> tuple[int, int, int, list[float]]:
    from gymbridge.bridge.iterator import read_rows
    from gymbridge.client import GymClient

    ok = failed = bad = 0
    rewards: list[float] = []
    jobs: list[tuple[int, int]] = []  # (task index, rollout index) of each submitted rollout

    def rows() -> Iterator[dict[str, Any]]:
        nonlocal bad
        for task_index, row in enumerate(read_rows(dataset)):
            if isinstance(row, Exception):
                bad += 1
                _write(failures_f, {"task_index": task_index, "kind": "gym_data", "reason": str(row)})
                continue
            for r in range(repeats):
                jobs.append((task_index, r))
                yield dict(row)

    async with GymClient(agent_url, deadline_s=deadline_s, max_connections=max(concurrency, 1)) as client:
        async for outcome in client.run_many(rows(), concurrency=concurrency, progress=progress):
            task_index, rollout_index = jobs[outcome.index]
            where = {"task_index": task_index, "rollout_index": rollout_index}
            if outcome.result is not None:
                ok += 1
                rewards.append(float(outcome.result.get("reward", 0.0)))
                meta = {**where, "attempts": outcome.attempts, "elapsed_s": round(outcome.elapsed_s, 4)}
                _write(results_f, {**outcome.result, "gymbridge": meta})
            else:
                failed += 1
                _write(failures_f, {**where, **outcome.failure_record()})
    return ok, failed, bad, rewards


def add_collect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--agent-url", required=True, help="base URL of a NeMo Gym agent (POST /run)")
    parser.add_argument("--dataset", type=Path, required=True, help="rows.jsonl (one Gym row per line)")
    parser.add_argument("--out", type=Path, required=True, help="results.jsonl")
    parser.add_argument("-n", "--repeats", type=int, default=1, help="rollouts per row (default 1)")
    parser.add_argument("--concurrency", type=int, default=32, help="rollouts in flight (default 32)")
    parser.add_argument("--deadline-s", type=float, default=900.0, help="deadline of one rollout (s)")
    parser.add_argument(
        "--failures", type=Path, default=None, help="failures file (default OUT.failures.jsonl)"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace earlier results at --out and the failures file"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=_cmd_collect)


def _cmd_collect(args: argparse.Namespace) -> int:
    summary = collect(
        args.agent_url,
        args.dataset,
        args.out,
        repeats=args.repeats,
        concurrency=args.concurrency,
        deadline_s=args.deadline_s,
        failures=args.failures,
        progress=not args.no_progress,
        overwrite=args.overwrite,
    )
    mean = "n/a" if summary.mean_reward is None else f"{summary.mean_reward:.3f}"
    print(
        f"collected {summary.rollouts_ok} rollouts ok, {summary.rollouts_failed} failed, "
        f"{summary.bad_rows} bad row(s); mean reward {mean}\n"
        f"results: {summary.results_path}\nfailures: {summary.failures_path}"
    )
    return 0
