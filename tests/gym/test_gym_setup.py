"""The gym venv set-up (``scripts/setup_gym_venv.sh``) and the suite's skip rule, without the gym venv.

Role: regression tests for how the conformance suite behaves on a fresh or broken machine. A set-up
failure must be one clear ``!! gym venv setup failed: <step>`` line, leave no half-state that the
suite mistakes for a usable venv, and make the suite SKIP quoting that line (CI stays green on a
machine that cannot build nemo-gym, but says why); a set-up that is up to date is a no-op. These
run whether or not ``.venv-gym`` exists (``NEEDS_GYM_VENV = False``) and never touch the network:
each runs a copy of the script in a scratch "repo" so the real ``.cache`` is untouched.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from _genuine import NEMO_GYM_VERSION, REPO_ROOT, gym_venv_problem

NEEDS_GYM_VENV = False

SCRIPT = REPO_ROOT / "scripts" / "setup_gym_venv.sh"
LOCK = REPO_ROOT / "requirements-gym.txt"


def scratch_repo(tmp_path: Path) -> Path:
    """A folder shaped like the repo for the script: scripts/setup_gym_venv.sh + the lock."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / SCRIPT.name)
    shutil.copy(LOCK, tmp_path / LOCK.name)
    return tmp_path


def run_setup(repo: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("GYM_")}
    full.update({"GYM_VENV": str(repo / ".venv-gym"), "GYM_WHEEL_DIR": str(repo / "no-wheels"), **env})
    return subprocess.run(
        ["bash", str(repo / "scripts" / SCRIPT.name)],
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def python311() -> str | None:
    """A python3.11 that actually runs (pyenv shims of absent versions do not)."""
    for name in ("python3.11", "python3"):
        path = shutil.which(name)
        if path is None:
            continue
        probe = subprocess.run(
            [path, "-c", "import sys, venv, ensurepip; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            check=False,
        )
        if probe.returncode == 0 and probe.stdout.strip() == "3.11":
            return path
    return None


def test_missing_interpreter_fails_clearly_and_keeps_the_existing_venv(tmp_path: Path) -> None:
    repo = scratch_repo(tmp_path)
    venv = repo / ".venv-gym"
    (venv / "bin").mkdir(parents=True)
    (venv / "keep-me").write_text("an older venv")
    proc = run_setup(repo, GYM_PYTHON="python3.99-not-installed")
    assert proc.returncode == 1
    assert "!! gym venv setup failed: interpreter python3.99-not-installed not found" in proc.stdout
    assert (venv / "keep-me").exists()  # checked before anything was removed
    note = (repo / ".cache" / "gym-setup-failed").read_text()
    assert "python3.99-not-installed not found" in note


def test_regression_pyenv_shim_of_absent_version_is_refused_before_removal(tmp_path: Path) -> None:
    """``command -v`` accepts a shim that cannot run: the script must run the interpreter to know."""
    repo = scratch_repo(tmp_path)
    shim = repo / "bin" / "python3.11"
    shim.parent.mkdir()
    shim.write_text("#!/bin/sh\necho 'pyenv: python3.11: command not found' >&2\nexit 127\n")
    shim.chmod(0o755)
    venv = repo / ".venv-gym"
    venv.mkdir()
    (venv / "keep-me").write_text("x")
    proc = run_setup(repo, GYM_PYTHON=str(shim))
    assert proc.returncode == 1
    assert "does not run" in proc.stdout, proc.stdout + proc.stderr
    assert (venv / "keep-me").exists()


def test_broken_lock_fails_at_step_1_and_the_suite_skips_quoting_it(tmp_path: Path) -> None:
    py = python311()
    if py is None:
        pytest.skip("no runnable python3.11 with venv/ensurepip on this machine")
    repo = scratch_repo(tmp_path)
    (repo / LOCK.name).write_text("this is !! not a requirement\n")  # a parse error: no index needed
    proc = run_setup(repo, GYM_PYTHON=py)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "!! gym venv setup failed: step 1: pip install -r requirements-gym.txt" in proc.stdout
    venv, note = repo / ".venv-gym", repo / ".cache" / "gym-setup-failed"
    assert not (venv / ".gymbridge-gym-stamp").exists()  # never marked usable
    assert not list((repo / ".cache").glob("gym-setup-tmp.*"))  # job-local scratch removed
    reason = gym_venv_problem(venv, note)
    assert reason is not None and "incomplete" in reason and "step 1" in reason


def test_up_to_date_venv_is_a_no_op(tmp_path: Path) -> None:
    repo = scratch_repo(tmp_path)
    venv = repo / ".venv-gym"
    (venv / "bin").mkdir(parents=True)
    fake_python = venv / "bin" / "python"
    fake_python.write_text("#!/bin/sh\nexit 99\n")  # would fail loudly if the script used it
    fake_python.chmod(0o755)
    digest = hashlib.sha256(LOCK.read_bytes()).hexdigest()
    (venv / ".gymbridge-gym-stamp").write_text(f"{digest} nemo-gym=={NEMO_GYM_VERSION}\n")
    proc = run_setup(repo, GYM_PYTHON="python3.99-not-installed")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gym venv up to date" in proc.stdout
    assert not (repo / ".cache").exists()  # nothing created, nothing locked

    # a changed lock is not "up to date": the script goes on to rebuild (and here fails clearly)
    (repo / LOCK.name).write_text(LOCK.read_text() + "# changed\n")
    proc = run_setup(repo, GYM_PYTHON="python3.99-not-installed")
    assert proc.returncode == 1 and "interpreter python3.99-not-installed not found" in proc.stdout


def test_skip_reason_names_the_fix(tmp_path: Path) -> None:
    absent = gym_venv_problem(tmp_path / "nowhere", tmp_path / "no-note")
    assert absent is not None and "setup_gym_venv.sh" in absent and "absent" in absent
    (tmp_path / "v" / "bin").mkdir(parents=True)
    (tmp_path / "v" / "bin" / "python").write_text("")
    assert "incomplete" in (gym_venv_problem(tmp_path / "v", tmp_path / "no-note") or "")
    (tmp_path / "v" / ".gymbridge-gym-stamp").write_text(f"abc nemo-gym=={NEMO_GYM_VERSION}\n")
    assert gym_venv_problem(tmp_path / "v", tmp_path / "no-note") is None
