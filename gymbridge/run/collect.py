"""``gymbridge collect``: roll a dataset out through any NeMo Gym agent, as ``ng_collect_rollouts`` does.

``gymbridge collect --agent-url URL --dataset rows.jsonl --out results.jsonl [-n 4]`` sends every
row ``n`` times to ``POST URL/run`` (:meth:`gymbridge.client.GymClient.run_many`: our deadlines,
retries of transport failures, a progress bar with the mean reward) and writes

* ``OUT``: one line per successful rollout, the agent's result (row echo + ``response`` +
  ``reward``) plus ``gymbridge: {task_index, rollout_index, attempts, elapsed_s}``;
* ``OUT`` with ``.failures.jsonl`` in place of ``.jsonl`` (or ``--failures PATH``): one record per
  failed rollout (:meth:`~gymbridge.client.RolloutOutcome.failure_record` plus ``task_index`` /
  ``rollout_index``) and per dataset line that is not a JSON object.

It prints the mean reward and NeMo Gym's pass@k summary (:mod:`gymbridge.metrics.passk`) of the
results grouped by dataset row (task index), each task's rollouts in rollout-index order:
pass@k, pass@1[avg-of-k] (k = ``-n``) and, with ``--answer-key FIELD`` (the result field holding
the extracted answer), majority@k and ``no_answer``. ``--summary-json PATH`` also writes
``{rollouts_ok, rollouts_failed, bad_rows, mean_reward, metrics}`` there (metrics: every key
:func:`~gymbridge.metrics.pass_majority_metrics` returns, percentages). Failed rollouts are left
out of pass@k, as NeMo Gym 0.7.0's collector leaves its failures-sidecar rows out by default: a
task is scored on the rollouts it completed (pass@k only over tasks with at least k) and a task
with none is not scored; the summary says how many were left out. ``--failures-as-zero`` counts
each as reward 0 without an answer instead (NeMo Gym's ``count_failure_classes_as_zero``). The
mean reward is over successful rollouts either way. For pass@k only each rollout's (reward,
answer) pair stays in memory; results themselves are streamed to disk.

Invariants: every (row, repeat) ends as exactly one line in one of the two files; both files
are written from scratch by each run and appended to (one whole line per write, flushed) as
outcomes arrive, so a run stopped early leaves whole lines only (and no summary). Nothing is lost
by mistake: ``--out``, the failures file or ``--summary-json`` naming the dataset (or each other)
is refused before anything is opened, and so are earlier results at any of them unless
``--overwrite`` is given.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson

from gymbridge.errors import ConfigError
from gymbridge.metrics.passk import pass_majority_metrics, summary_lines, vote_key

__all__ = ["CollectSummary", "add_collect_arguments", "collect"]


@dataclass(frozen=True)
class CollectSummary:
    rollouts_ok: int
    rollouts_failed: int
    bad_rows: int
    mean_reward: float | None
    results_path: Path
    failures_path: Path
    metrics: dict[str, float] = field(default_factory=dict)
    """:func:`~gymbridge.metrics.pass_majority_metrics` of the results grouped by task (module)."""
    tasks_scored: int = 0
    """Tasks (dataset rows) with at least one rollout in ``metrics``."""
    failures_as_zero: bool = False
    """Whether failed rollouts are in ``metrics`` as reward 0 (else left out)."""
    summary_path: Path | None = None

    def to_json(self) -> dict[str, Any]:
        """What ``--summary-json`` writes."""
        return {
            "rollouts_ok": self.rollouts_ok,
            "rollouts_failed": self.rollouts_failed,
            "bad_rows": self.bad_rows,
            "mean_reward": self.mean_reward,
            "metrics": self.metrics,
        }


class _TaskScores:
    """Per task, per rollout: the (reward, answer) pair pass@k needs, not the whole result."""

    _ANSWER = "answer"

    def __init__(self, answer_key: str | None) -> None:
        self.answer_key = answer_key
        self._by_task: dict[int, dict[int, tuple[float, Hashable | None]]] = {}

    def add(
        self, task_index: int, rollout_index: int, reward: float, result: Mapping[str, Any] | None
    ) -> None:
        answer = None
        if self.answer_key is not None and result is not None:
            answer = vote_key(result.get(self.answer_key))
        self._by_task.setdefault(task_index, {})[rollout_index] = (reward, answer)

    def __len__(self) -> int:
        return len(self._by_task)

    def metrics(self) -> dict[str, float]:
        tasks = [
            [{"reward": reward, self._ANSWER: answer} for _, (reward, answer) in sorted(rollouts.items())]
            for _, rollouts in sorted(self._by_task.items())
        ]
        return pass_majority_metrics(tasks, answer_key=None if self.answer_key is None else self._ANSWER)


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
    answer_key: str | None = None,
    failures_as_zero: bool = False,
    summary_json: Path | None = None,
) -> CollectSummary:
    """Run every row of ``dataset`` ``repeats`` times through the agent at ``agent_url``; see the module.

    ``overwrite``: replace earlier results at ``out``, the failures file and ``summary_json`` (else
    refused). ``answer_key``: the result field with the extracted answer (majority@k, ``no_answer``).
    ``failures_as_zero``: failed rollouts count in pass@k as reward 0 without an answer.
    ``summary_json``: also write :meth:`CollectSummary.to_json` there.
    """
    if repeats < 1:
        raise ConfigError([f"-n must be >= 1, got {repeats}"])
    if not dataset.is_file():
        raise ConfigError([f"--dataset {dataset}: no such file"])
    failures = failures if failures is not None else _failures_path(out)
    _check_paths(dataset, out, failures, summary_json, overwrite=overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    failures.parent.mkdir(parents=True, exist_ok=True)
    scores = _TaskScores(answer_key)
    with out.open("wb") as results_f, failures.open("wb") as failures_f:
        ok, failed, bad, rewards = asyncio.run(
            _collect(
                agent_url,
                dataset,
                results_f,
                failures_f,
                repeats,
                concurrency,
                deadline_s,
                progress,
                scores,
                failures_as_zero,
            )
        )
    mean = sum(rewards) / len(rewards) if rewards else None
    summary = CollectSummary(
        ok, failed, bad, mean, out, failures, scores.metrics(), len(scores), failures_as_zero, summary_json
    )
    if summary_json is not None:
        summary_json.parent.mkdir(parents=True, exist_ok=True)
        summary_json.write_bytes(orjson.dumps(summary.to_json(), option=orjson.OPT_INDENT_2) + b"\n")
    return summary


def _same(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve() or (a.exists() and b.exists() and a.samefile(b))


def _check_paths(dataset: Path, out: Path, failures: Path, summary: Path | None, *, overwrite: bool) -> None:
    """Refuse output paths that would empty the dataset or each other, or earlier results (module)."""
    problems = []
    outputs = [("--out", out), ("--failures", failures)]
    if summary is not None:
        outputs.append(("--summary-json", summary))
    for flag, path in outputs:
        if _same(path, dataset):
            problems.append(f"{flag} {path} is the dataset: writing it would empty it before it is read")
    for i, (flag_a, a) in enumerate(outputs):
        for flag_b, b in outputs[i + 1 :]:
            if _same(a, b):
                problems.append(f"{flag_a} and {flag_b} are the same file ({a})")
    if not overwrite:
        for flag, path in outputs:
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
    scores: _TaskScores,
    failures_as_zero: bool,
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
                reward = float(outcome.result.get("reward", 0.0))
                rewards.append(reward)
                scores.add(task_index, rollout_index, reward, outcome.result)
                meta = {**where, "attempts": outcome.attempts, "elapsed_s": round(outcome.elapsed_s, 4)}
                _write(results_f, {**outcome.result, "gymbridge": meta})
            else:
                failed += 1
                if failures_as_zero:
                    scores.add(task_index, rollout_index, 0.0, None)
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
        "--overwrite",
        action="store_true",
        help="replace earlier results at --out, the failures file and --summary-json",
    )
    parser.add_argument(
        "--answer-key",
        default=None,
        metavar="FIELD",
        help="result field holding each rollout's extracted answer: adds majority@k and no_answer",
    )
    parser.add_argument(
        "--failures-as-zero",
        action="store_true",
        help="count failed rollouts in pass@k as reward 0 (default: left out, as NeMo Gym does)",
    )
    parser.add_argument(
        "--summary-json",
        type=Path,
        default=None,
        metavar="PATH",
        help="also write {rollouts_ok, rollouts_failed, bad_rows, mean_reward, metrics} there as JSON",
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
        answer_key=args.answer_key,
        failures_as_zero=args.failures_as_zero,
        summary_json=args.summary_json,
    )
    mean = "n/a" if summary.mean_reward is None else f"{summary.mean_reward:.3f}"
    print(
        f"collected {summary.rollouts_ok} rollouts ok, {summary.rollouts_failed} failed, "
        f"{summary.bad_rows} bad row(s); mean reward {mean}"
    )
    print(_passk_header(summary))
    for line in summary_lines(summary.metrics, k=args.repeats):
        print(f"  {line}")
    print(f"results: {summary.results_path}\nfailures: {summary.failures_path}")
    if summary.summary_path is not None:
        print(f"summary: {summary.summary_path}")
    return 0


def _passk_header(summary: CollectSummary) -> str:
    """What the pass@k lines are computed over, failures included (module: how they count)."""
    counted = summary.rollouts_ok
    failures = ""
    if summary.rollouts_failed and summary.failures_as_zero:
        counted += summary.rollouts_failed
        failures = f"; {summary.rollouts_failed} failed rollout(s) counted as reward 0"
    elif summary.rollouts_failed:
        failures = f"; {summary.rollouts_failed} failed rollout(s) left out (--failures-as-zero counts them)"
    return f"pass@k over {counted} rollout(s) of {summary.tasks_scored} task(s){failures}:"
