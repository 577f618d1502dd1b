"""The ``gymbridge`` CLI: env list / data / serve, and the command-group dispatch table."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from gymbridge import cli
from gymbridge.server import free_port

REPO = Path(__file__).resolve().parents[1]
# The CLI finds environments/ beside the checkout even when the repo root is not on sys.path.
get_env = cli._environments().get_env


def test_env_list_names_every_environment(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["env", "list", "--params"]) == 0
    out = capsys.readouterr().out
    for name in ("circle_click", "zoom_read", "beep_count", "bouncing_ball", "counter", "grid_door"):
        assert name in out
    assert "--param img_size=320" in out


def test_env_data_writes_the_generators_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sub" / "rows.jsonl"
    code = cli.main(["env", "data", "counter", "--n", "4", "--seed", "3", "--out", str(out)])
    assert code == 0 and "wrote 4 counter rows" in capsys.readouterr().err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == list(get_env("counter").generate(4, seed=3))


def test_env_data_params_are_yaml_typed(tmp_path: Path) -> None:
    out = tmp_path / "cc.jsonl"
    assert (
        cli.main(["env", "data", "circle_click", "--n", "1", "--out", str(out), "--param", "img_size=200"])
        == 0
    )
    row = json.loads(out.read_text())
    assert "200x200 pixel image" in row["responses_create_params"]["input"][1]["content"][1]["text"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["env", "data", "nope", "--n", "1", "--out", "X"], "unknown environment 'nope'"),
        (
            ["env", "data", "counter", "--n", "1", "--out", "X", "--param", "colour=red"],
            "unknown generator parameter",
        ),
        (["env", "data", "beep_count", "--n", "1", "--out", "X", "--param", "audio_via=both"], "audio_via"),
        (["env", "data", "counter", "--n", "-1", "--out", "X"], "--n must be >= 0"),
    ],
)
def test_bad_input_exits_2_with_one_clear_line(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [str(tmp_path / a) if a == "X" else a for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "X").exists()  # nothing half-written


def _add_demo_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("hello")
    p.set_defaults(func=lambda args: 7)


def test_a_new_group_is_one_table_entry_and_a_broken_group_breaks_nothing_else(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(cli.COMMAND_GROUPS, "demo", ("a demo group", f"{__name__}:_add_demo_commands"))
    monkeypatch.setitem(cli.COMMAND_GROUPS, "broken", ("not installed", "no_such_module_xyz:add"))
    assert cli.main(["demo", "hello"]) == 7
    assert cli.main(["env", "list"]) == 0
    assert cli.main(["broken", "run"]) == 2
    assert "no_such_module_xyz" in capsys.readouterr().err


def test_env_serve_runs_a_conformant_server_in_a_subprocess(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "gymbridge.cli",
        "env",
        "serve",
        "counter",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/", timeout=1.0).json() == {"status": "ok"}:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            # wallclock-ok: hang guard (a start-up takes 2-15 s)
            assert time.monotonic() < deadline, "server did not come up within 120 s"
            time.sleep(0.1)
        row = get_env("counter").make_row(0, 0)
        with httpx.Client(base_url=url, timeout=5.0) as client:
            client.post("/seed_session", json=row).raise_for_status()
            for k in row["increments"]:
                client.post("/increment_counter", json={"count": k}).raise_for_status()
            assert client.post("/get_counter_value", json={}).json() == {"count": row["expected_count"]}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - only on a wedged server
            proc.kill()
            proc.wait()
