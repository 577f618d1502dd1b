"""``gymbridge collect``: every (row, repeat) lands in results or failures; bad lines are failures too;
the pass@k summary groups the results by row, leaves failures out (or counts them as 0) and says so."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import orjson
import pytest

from gymbridge.cli import main as cli_main
from gymbridge.errors import ConfigError
from gymbridge.metrics import pass_majority_metrics
from gymbridge.run.collect import _TaskScores, collect
from gymbridge.server import SimpleAgent, start_server
from gymbridge.testing.scripted_model import ScriptedModelServer
from gymbridge_envs.color_pick.data import generate
from gymbridge_envs.color_pick.server import ColorPickServer

pytestmark = pytest.mark.integration


def _lines(path: Path) -> list[dict[str, object]]:
    return [orjson.loads(x) for x in path.read_bytes().splitlines() if x.strip()]


async def test_collect_writes_results_failures_and_repeats(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = list(generate(2, 0))  # one red, one blue row
    assert sorted(r["color"] for r in rows) == ["blue", "red"]
    bad_row = {**rows[0]}
    del bad_row["color"]  # the env refuses it (422): a data failure, recorded
    dataset = tmp_path / "rows.jsonl"
    dataset.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in [*rows, bad_row]) + b"not json\n")
    env = await start_server(ColorPickServer())
    model = ScriptedModelServer(["red"] * 100)  # always answers red
    await model.start()
    agent = await start_server(SimpleAgent(resources_url=env.url, model_url=model.url, max_steps=1))
    out = tmp_path / "results.jsonl"
    try:
        argv = ["collect", "--agent-url", agent.url, "--dataset", str(dataset), "--out", str(out), "-n", "3"]
        rc = await asyncio.to_thread(cli_main, [*argv, "--no-progress", "--deadline-s", "30"])
    finally:
        await agent.stop()
        await model.stop()
        await env.stop()
    assert rc == 0
    results = _lines(out)
    failures = _lines(tmp_path / "results.failures.jsonl")
    assert len(results) == 6  # 2 good rows x 3 repeats
    by_row = sorted(
        (r["gymbridge"]["task_index"], r["gymbridge"]["rollout_index"], r["reward"]) for r in results
    )  # type: ignore[index]
    red = next(i for i, r in enumerate(rows) if r["color"] == "red")
    assert by_row == sorted((i, k, 1.0 if i == red else 0.0) for i in (0, 1) for k in range(3))
    assert sorted((f["task_index"], f.get("rollout_index")) for f in failures) == [
        (2, 0),
        (2, 1),
        (2, 2),
        (3, None),
    ]
    assert {f["kind"] for f in failures if f["task_index"] == 3} == {"gym_data"}
    text = capsys.readouterr().out
    assert "collected 6 rollouts ok, 3 failed, 1 bad row(s); mean reward 0.500" in text
    assert "pass@k over 6 rollout(s) of 2 task(s); 3 failed rollout(s) left out" in text
    assert "  accuracy: pass@1[avg-of-3] 50.00% (s.e. 0.00), pass@3 50.00%" in text


async def _collect_color_pick(tmp_path: Path, *extra: str) -> tuple[int, str]:
    """Two good rows (red, blue) and one the env refuses, -n 3, one rollout at a time, the model
    answering red, blue, red, red, blue, red: the red row scores [1, 0, 1], the blue row [0, 1, 0]."""
    rows = list(generate(2, 0))
    bad_row = {**rows[0]}
    del bad_row["color"]
    dataset = tmp_path / "rows.jsonl"
    dataset.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in [*rows, bad_row]))
    answers = itertools.cycle(["red", "blue", "red"])
    env = await start_server(ColorPickServer())
    model = ScriptedModelServer(lambda body: next(answers))
    await model.start()
    agent = await start_server(SimpleAgent(resources_url=env.url, model_url=model.url, max_steps=1))
    out = tmp_path / "results.jsonl"
    argv = ["collect", "--agent-url", agent.url, "--dataset", str(dataset), "--out", str(out), "-n", "3"]
    try:
        rc = await asyncio.to_thread(
            cli_main, [*argv, "--concurrency", "1", "--no-progress", "--deadline-s", "30", *extra]
        )
    finally:
        await agent.stop()
        await model.stop()
        await env.stop()
    return rc, str(rows[0]["color"])


async def test_collect_reports_pass_at_k_grouped_by_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    summary_path = tmp_path / "summary.json"
    rc, _ = await _collect_color_pick(tmp_path, "--answer-key", "answer", "--summary-json", str(summary_path))
    assert rc == 0
    summary = orjson.loads(summary_path.read_bytes())
    assert {k: summary[k] for k in ("rollouts_ok", "rollouts_failed", "bad_rows", "mean_reward")} == {
        "rollouts_ok": 6,
        "rollouts_failed": 3,
        "bad_rows": 0,
        "mean_reward": 0.5,
    }
    assert set(summary) == {"rollouts_ok", "rollouts_failed", "bad_rows", "mean_reward", "metrics"}
    metrics = summary["metrics"]
    assert metrics["pass@1/accuracy"] == pytest.approx(100 * (2 / 3 + 1 / 3) / 2)
    assert metrics["pass@2/accuracy"] == pytest.approx(100 * (1 + 2 / 3) / 2)  # blue: 1 - C(2,2)/C(3,2)
    assert metrics["pass@3/accuracy"] == pytest.approx(100.0)
    assert metrics["majority@3/accuracy"] == pytest.approx(50.0)  # red wins both votes: 1, then 0
    assert metrics["pass@1[avg-of-3]/no_answer"] == 0.0
    # the same as the function over the results file grouped by row, in rollout order
    by_task: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for r in _lines(tmp_path / "results.jsonl"):
        meta: Any = r["gymbridge"]
        by_task.setdefault(meta["task_index"], []).append((meta["rollout_index"], r))
    tasks = [[r for _, r in sorted(by_task[t], key=lambda x: x[0])] for t in sorted(by_task)]
    assert metrics == pytest.approx(pass_majority_metrics(tasks, answer_key="answer"), abs=1e-12)
    text = capsys.readouterr().out
    assert "pass@k over 6 rollout(s) of 2 task(s); 3 failed rollout(s) left out (--failures-as-zero" in text
    assert "  accuracy:  pass@1[avg-of-3] 50.00% (s.e. 0.00), pass@3 100.00%, majority@3 50.00%" in text
    assert "  no_answer: pass@1[avg-of-3] 0.00% (s.e. 0.00)" in text
    assert f"summary: {summary_path}" in text


async def test_collect_failures_as_zero_scores_failed_rollouts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    summary_path = tmp_path / "summary.json"
    rc, _ = await _collect_color_pick(tmp_path, "--failures-as-zero", "--summary-json", str(summary_path))
    assert rc == 0
    summary = orjson.loads(summary_path.read_bytes())
    assert summary["mean_reward"] == 0.5  # over successful rollouts either way
    assert summary["metrics"]["pass@1[avg-of-3]/accuracy"] == pytest.approx(100 * (2 / 3 + 1 / 3 + 0) / 3)
    assert summary["metrics"]["pass@3/accuracy"] == pytest.approx(100 * 2 / 3)
    assert not any("majority" in k or "no_answer" in k for k in summary["metrics"])  # no --answer-key
    text = capsys.readouterr().out
    assert "pass@k over 9 rollout(s) of 3 task(s); 3 failed rollout(s) counted as reward 0:" in text


def test_summary_json_may_not_overwrite_the_dataset_the_results_or_earlier_summaries(tmp_path: Path) -> None:
    dataset = tmp_path / "rows.jsonl"
    dataset.write_bytes(b"{}\n")
    out = tmp_path / "results.jsonl"
    for summary, problem in (
        (dataset, r"--summary-json .* is the dataset"),
        (out, "--out and --summary-json are the same file"),
    ):
        with pytest.raises(ConfigError, match=problem):
            collect("http://127.0.0.1:9", dataset, out, summary_json=summary, progress=False)
    earlier = tmp_path / "summary.json"
    earlier.write_bytes(b"{}")
    with pytest.raises(ConfigError, match=r"--summary-json .* holds earlier results; pass --overwrite"):
        collect("http://127.0.0.1:9", dataset, out, summary_json=earlier, progress=False)
    assert earlier.read_bytes() == b"{}" and not out.exists()


def test_task_scores_keep_rollout_order_and_vote_on_structured_answers() -> None:
    scores = _TaskScores("answer")
    # outcomes arrive in completion order; pass@1[avg-of-1] must read rollout 0 of each task
    scores.add(0, 1, 0.0, {"answer": ["x", 1], "reward": 0.0, "response": {"output": ["big"]}})
    scores.add(1, 0, 1.0, {"answer": {"b": 2, "a": 1}})
    scores.add(0, 0, 1.0, {"answer": ["x", 1]})
    scores.add(1, 1, 1.0, {"answer": {"a": 1, "b": 2}})
    scores.add(0, 2, 1.0, None)  # a failed rollout counted as zero: no answer
    metrics = scores.metrics()
    assert len(scores) == 2
    assert metrics["pass@1[avg-of-1]/accuracy"] == 100.0
    assert metrics["majority@2/accuracy"] == pytest.approx(100 * (0.5 + 1) / 2)  # task 1: one answer, twice
    assert metrics["pass@1[avg-of-3]/no_answer"] == pytest.approx(100 * (1 / 3 + 0) / 2)
