"""A run's secret never leaves the launcher except into its child's environment.

``gymbridge smoke run --set generator.placement=process`` makes a run secret, hands it to the child
model server through ``GYMBRIDGE_WEIGHTS_SECRET`` and to its publisher: the weights still reach the
child at every step, and the secret is in none of the child's argv (``/proc/<pid>/cmdline``, what
``ps`` shows), the run directory's files (config.yaml, logs, the child's own log, ...), the console
or the captured log records.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from run_helpers import quiet_train, run_config

from gymbridge.generation.server import WEIGHTS_SECRET_ENV

pytestmark = pytest.mark.integration

SMALL = {
    "steps": 2,
    "bridge.prompts_per_step": 2,
    "bridge.group_size": 2,
    "rollout.max_tokens": 8,
    "warmup.steps": 0,
    "shaping.kind": "token_rate",
    "generator.placement": "process",
}


def test_a_process_placement_run_syncs_and_its_secret_is_nowhere_on_disk_argv_or_logs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from gymbridge.run import generator_process, placement

    made: list[str] = []
    argv: list[bytes] = []
    child_env: list[bytes] = []
    real_token = secrets.token_urlsafe
    real_start = generator_process.start_model_server_process

    def token(nbytes: int | None = None) -> str:
        made.append(real_token(nbytes))
        return made[-1]

    def recording(*a: Any, **k: Any) -> generator_process.ModelServerProcess:
        child = real_start(*a, **k)
        argv.append(Path(f"/proc/{child.pid}/cmdline").read_bytes())
        child_env.append(Path(f"/proc/{child.pid}/environ").read_bytes())
        return child

    monkeypatch.setattr(placement, "secrets", SimpleNamespace(token_urlsafe=token))  # the launcher's only
    monkeypatch.setattr(generator_process, "start_model_server_process", recording)
    caplog.set_level("DEBUG")
    run_dir = tmp_path / "run"
    result, console = quiet_train(run_config(run_dir, SMALL))

    (secret,) = made
    trained = [m for m in result.steps if m.skipped is None]
    assert trained and [m.policy_version for m in trained] == list(range(1, len(trained) + 1))
    assert all(abs(m.ratio_mean - 1.0) < 1e-3 for m in trained)  # the child got every version
    assert f"{WEIGHTS_SECRET_ENV}={secret}".encode() in child_env[0].split(b"\0")  # delivered ...
    assert b"--enable-weight-updates" in argv[0] and secret.encode() not in argv[0]  # ... never in argv
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert (run_dir / "model_server.log") in files and (run_dir / "config.yaml") in files
    leaked = [str(p.relative_to(run_dir)) for p in files if secret.encode() in p.read_bytes()]
    assert leaked == []
    assert secret not in console and secret not in caplog.text
