"""Direction: the genuine NeMo Gym collector -> gymbridge's agent and environment.

The genuine rollout collector (the library entry point behind ``gym eval run --no-serve``,
``nemo_gym.cli.eval.collect_rollouts``) reads a jsonl of rows, repeats each, and collects them
through a genuine ``environment_servers/legacy_agent`` relay (0.7.0 collects through environment
servers) from **our** ``SimpleAgent`` in front of **our** ``counter`` environment. The mean reward
it reports must be the one the scripts earn (3 of 4 tasks solved -> 0.75). ``gymbridge collect``
sent the same rows reports the pass@k that genuine ``compute_pass_majority_metrics`` computes over
the genuine collector's rollouts, key for key.

The relay starts a local Ray instance (it does not declare ``ray_enabled``); the launcher pins it to
loopback (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: no node-IP probe towards outside addresses) and
to a job-local ``RAY_TMPDIR``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _genuine import GenuineStack
from _gym_support import ScriptBook, ThreadedLoop, genuine_relay_to_our_agent
from _oracles import counter as counter_oracle

import gymbridge.server as server_sdk
import gymbridge_envs.counter.data as counter_data
import gymbridge_envs.counter.server as counter_server
from gymbridge.run.collect import collect

pytestmark = pytest.mark.gym


@pytest.fixture
def ours_behind_genuine_relay(
    fixture_loop: ThreadedLoop, scripted_model_url: str, tmp_path: Path
) -> Iterator[GenuineStack]:
    env = fixture_loop.run(
        server_sdk.start_server(counter_server.CounterServer(instance_name="ours_counter"))
    )
    try:
        with genuine_relay_to_our_agent(
            fixture_loop, env.url, scripted_model_url, tmp_path / "logs"
        ) as stack:
            yield stack
    finally:
        fixture_loop.run(env.stop())


def _counter_rows(script_book: ScriptBook, prefix: str, wrong: set[int]) -> list[dict[str, Any]]:
    """Four scripted counter rows, the tasks in ``wrong`` answered wrongly (reward 0)."""
    rows: list[dict[str, Any]] = []
    for i, row in enumerate(counter_data.generate(4, seed=5)):
        script = counter_oracle(row)
        if i in wrong:
            script = [{"calls": [{"name": "increment_counter", "arguments": {"count": 1000}}]}, "done"]
        row = copy.deepcopy(row)
        row["responses_create_params"]["metadata"] = {"script": script_book.add(f"{prefix}-{i}", script)}
        rows.append(row)
    return rows


def test_genuine_collector_mean_reward(
    ours_behind_genuine_relay: GenuineStack, script_book: ScriptBook, tmp_path: Path
) -> None:
    # one task answered wrongly: the collector must report 0.75, not 1.0
    rows = _counter_rows(script_book, "collector", wrong={3})
    inp, out = tmp_path / "rows.jsonl", tmp_path / "rollouts.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))

    proc = ours_behind_genuine_relay.collect("ours_agent", inp, out, num_repeats=2, num_samples_in_parallel=4)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])

    rollouts = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rollouts) == 8
    by_task: dict[int, list[float]] = {}
    for r in rollouts:
        by_task.setdefault(r["_ng_task_index"], []).append(r["reward"])
    assert by_task == {0: [1.0, 1.0], 1: [1.0, 1.0], 2: [1.0, 1.0], 3: [0.0, 0.0]}
    assert all(r["response"]["output"][-1]["type"] == "message" for r in rollouts)
    assert (tmp_path / "rollouts_failures.jsonl").read_text() == ""

    (metrics,) = json.loads((tmp_path / "rollouts_aggregate_metrics.json").read_text())
    assert metrics["agent_metrics"]["num_rollouts"] == 8
    assert metrics["agent_metrics"]["mean/reward"] == pytest.approx(0.75)
    assert metrics["key_metrics"]["mean/reward"] == pytest.approx(0.75)


def test_collect_pass_at_k_equals_genuine_over_the_genuine_collectors_rollouts(
    ours_behind_genuine_relay: GenuineStack, script_book: ScriptBook, tmp_path: Path
) -> None:
    from test_gym_passk_genuine import genuine_pass_majority_metrics

    rows = _counter_rows(script_book, "collect-passk", wrong={1, 3})
    inp = tmp_path / "rows.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    theirs_out = tmp_path / "genuine" / "rollouts.jsonl"
    theirs_out.parent.mkdir()
    proc = ours_behind_genuine_relay.collect(
        "ours_agent", inp, theirs_out, num_repeats=3, num_samples_in_parallel=4
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    by_task: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for line in theirs_out.read_text().splitlines():
        r = json.loads(line)
        by_task.setdefault(r["_ng_task_index"], []).append((r["_ng_rollout_index"], r))
    tasks = [[r for _, r in sorted(by_task[t], key=lambda x: x[0])] for t in sorted(by_task)]
    assert all("final_count" in r for task in tasks for r in task)
    (theirs,) = genuine_pass_majority_metrics([{"tasks": tasks, "fields": None, "answer_key": "final_count"}])
    del theirs["per_sample_aggregate"]

    summary = collect(
        ours_behind_genuine_relay.url("ours_agent"),
        inp,
        tmp_path / "ours" / "results.jsonl",
        repeats=3,
        concurrency=4,
        deadline_s=60,
        progress=False,
        answer_key="final_count",
    )
    assert (summary.rollouts_ok, summary.rollouts_failed, summary.tasks_scored) == (12, 0, 4)
    assert set(summary.metrics) == set(theirs)
    assert summary.metrics == pytest.approx(theirs, abs=1e-9)
    assert summary.metrics["pass@3/accuracy"] == pytest.approx(50.0)  # 2 of 4 tasks solved, every time
