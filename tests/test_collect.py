"""``gymbridge collect``: every (row, repeat) lands in results or failures; bad lines are failures too."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from gymbridge.cli import main as cli_main
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
