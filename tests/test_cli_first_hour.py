"""Errors a user meets in the first hour: one typed line, exit code 2, never a traceback.

The port cases run the installed ``gymbridge`` command in a subprocess (what a user types) and
check that no server announced itself (``serving ... on``) when it could not bind its port;
the others call ``gymbridge.cli.main`` in this process (the same code path, without paying a
process start per case) and check the exit code and the one ``error:`` line.
"""

from __future__ import annotations

import contextlib
import io
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gymbridge import cli

GYMBRIDGE = str(Path(sys.executable).with_name("gymbridge"))
REPO = Path(__file__).resolve().parents[1]


def _run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GYMBRIDGE, *argv], capture_output=True, text=True, timeout=timeout, cwd=REPO)


def _fails(*argv: str, match: str, timeout: float = 120) -> str:
    proc = _run(*argv, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out, out
    assert "serving" not in out, out  # nothing announced itself
    assert match in out, out
    return out


def _fails_here(*argv: str, match: str) -> str:
    """``gymbridge ARGV`` in this process: exit code 2, ``match`` in its output, nothing announced."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(argv))
        except SystemExit as exc:  # argparse refusing a flag
            code = int(exc.code or 0)
    text = out.getvalue() + err.getvalue()
    assert code == 2, text
    assert "serving" not in text and match in text, text
    return text


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another process is listening on (127.0.0.1)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


@pytest.mark.parametrize(
    "command",
    [
        ["env", "serve", "counter"],
        ["model", "serve", "--tiny"],
        ["agent", "serve", "--resources-url", "http://127.0.0.1:1", "--model-url", "http://127.0.0.1:2"],
    ],
    ids=["env", "model", "agent"],
)
def test_regression_port_in_use_is_one_line_before_anything_is_announced(
    command: list[str], taken_port: int
) -> None:
    """env serve printed 'serving ... on' and then died with an OSError traceback."""
    out = _fails(*command, "--port", str(taken_port), match=f"cannot listen on 127.0.0.1:{taken_port}")
    assert "already in use" in out


@pytest.mark.parametrize(
    ("command", "port", "match"),
    [
        (["env", "serve", "counter"], "70000", "port 70000 is out of range"),
        (["model", "serve", "--tiny"], "-1", "port -1 is out of range"),
        (["agent", "serve"], "eighty", "not a port number: 'eighty'"),
    ],
    ids=["env", "model", "agent"],
)
def test_port_out_of_range_is_refused_by_every_server(command: list[str], port: str, match: str) -> None:
    _fails_here(*command, "--port", port, match=match)


def test_python_m_gymbridge_server_agent_keeps_working() -> None:
    module = [sys.executable, "-m", "gymbridge.server", "agent"]
    proc = subprocess.run([*module, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--resources-url" in proc.stdout
    bad = subprocess.run(
        [*module, "--resources-url", "x", "--model-url", "y"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "not an http(s) URL" in bad.stderr and "Traceback" not in bad.stderr


def test_agent_serve_has_help_on_every_flag() -> None:
    proc = _run("agent", "serve", "--help")
    assert proc.returncode == 0
    flags = [line.split()[0] for line in proc.stdout.splitlines() if line.strip().startswith("--")]
    assert {"--resources-url", "--model-url", "--port", "--max-steps", "--gymnasium", "--tool-media"} <= set(
        flags
    )
    import argparse

    from gymbridge.server.cli import add_agent_arguments

    parser = argparse.ArgumentParser()
    add_agent_arguments(parser)
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help text"


def test_regression_env_serve_and_model_serve_default_ports_differ() -> None:
    """Both defaulted to 8000: the second server of a stack started without flags failed."""
    from gymbridge.cli import DEFAULT_AGENT_PORT, DEFAULT_ENV_PORT, DEFAULT_MODEL_PORT

    assert len({DEFAULT_ENV_PORT, DEFAULT_MODEL_PORT, DEFAULT_AGENT_PORT}) == 3
    assert f"default {DEFAULT_ENV_PORT}" in _run("env", "serve", "--help").stdout
    assert f"default {DEFAULT_MODEL_PORT}" in _run("model", "serve", "--help").stdout


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda tmp: tmp / "missing", "no such file or directory"),
        (lambda tmp: tmp, "the directory is empty"),
        (lambda tmp: (tmp / "weights.bin").write_bytes(b"x") and tmp / "weights.bin", "is a file"),
        (lambda tmp: (tmp / "notes.txt").write_text("x") and tmp, "has no config.json"),
    ],
    ids=["missing", "empty-dir", "a-file", "no-config"],
)
def test_regression_model_serve_bad_model_path(tmp_path: Path, make: object, match: str) -> None:
    """A bad --model path ended in a transformers traceback after seconds of imports."""
    model = make(tmp_path)  # type: ignore[operator]
    _fails_here("model", "serve", "--model", str(model), "--port", "0", match=match)


def test_regression_env_data_out_naming_a_directory(tmp_path: Path) -> None:
    _fails_here("env", "data", "counter", "--n", "2", "--out", str(tmp_path), match="is a directory")


@pytest.mark.parametrize(
    ("param", "match"),
    [
        ("img_size=abc", "img_size takes int, >= 32, <= 4096, got 'abc'"),
        ("img_size=8", "img_size takes int, >= 32"),
        ("radius_min=1.5", "radius_min takes int"),
        ("bogus=1", "unknown generator parameter 'bogus'"),
    ],
)
def test_regression_generator_parameters_of_the_wrong_type_or_range(
    tmp_path: Path, param: str, match: str
) -> None:
    """img_size=abc reached the generator and crashed with a TypeError traceback."""
    _fails_here(
        "env",
        "data",
        "circle_click",
        "--n",
        "1",
        "--out",
        str(tmp_path / "r.jsonl"),
        "--param",
        param,
        match=match,
    )


def test_env_list_params_shows_types_and_ranges() -> None:
    out = _run("env", "list", "--params").stdout
    assert "--param img_size=320  (int, >= 32, <= 4096)" in out
    assert "--param audio_via='metadata'  ('metadata' | 'part')" in out


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--set", "trainer.lr=-1"], "lr"),
        (["--set", "trainer.lr=.nan"], "lr"),
        (
            ["--group-size", "2", "--set", "bridge.min_group_size=4"],
            "min_group_size (4) is larger than group_size (2)",
        ),
        (["--set", "env.params.img_size=abc"], "img_size takes int"),
    ],
    ids=["negative-lr", "nan-lr", "min-group-size", "env-params"],
)
def test_regression_smoke_config_errors_before_any_server_starts(args: list[str], match: str) -> None:
    """min_group_size > group_size raised a ValueError traceback after every server had started."""
    out = _fails_here("smoke", "run", "--no-progress", *args, match=match)
    assert "servers:" not in out


def test_regression_smoke_run_dir_naming_a_file(tmp_path: Path) -> None:
    afile = tmp_path / "runs.txt"
    afile.write_text("not a folder")
    out = _fails("smoke", "run", "--no-progress", "--run-dir", str(afile), match="is a file, not a folder")
    assert "servers:" not in out
