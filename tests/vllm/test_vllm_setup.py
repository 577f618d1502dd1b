"""``scripts/setup_vllm_venv.sh`` on a fresh or broken machine, without building anything.

A set-up failure must be one clear ``!! vllm venv setup failed: <step>`` line kept in
``.cache/vllm-setup-failed`` (the suite's skip reason quotes it), leave any existing venv alone, and
an up-to-date venv must be a no-op. Each runs a copy of the script in a scratch "repo" (no network).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from _vllm_venv import REPO_ROOT, VLLM_VERSION, vllm_venv_problem

NEEDS_VLLM_VENV = False

SCRIPT = REPO_ROOT / "scripts" / "setup_vllm_venv.sh"
LOCK = REPO_ROOT / "requirements-vllm.txt"


def scratch_repo(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / SCRIPT.name)
    shutil.copy(LOCK, tmp_path / LOCK.name)
    return tmp_path


def run_setup(repo: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    full.update({"VLLM_VENV": str(repo / ".venv-vllm"), **env})
    return subprocess.run(
        ["bash", str(repo / "scripts" / SCRIPT.name)],
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_lock_pins_the_tested_vllm_and_its_torch() -> None:
    pins = dict(line.split("==", 1) for line in LOCK.read_text().splitlines() if "==" in line)
    assert pins["vllm"] == VLLM_VERSION
    assert pins["torch"] == "2.14.0" and pins["transformers"].startswith("5.20.")
    for base in ("av", "soundfile", "tenacity", "omegaconf", "pydantic", "httpx"):
        assert base in pins, f"gymbridge's base dependency {base} is missing from the lock"
    # pip freeze leaves setuptools out unless --all; torch 2.14 requires setuptools>=77 (pip check)
    assert int(pins["setuptools"].split(".")[0]) >= 77


def test_missing_interpreter_fails_clearly_and_keeps_the_existing_venv(tmp_path: Path) -> None:
    repo = scratch_repo(tmp_path)
    venv = repo / ".venv-vllm"
    (venv / "bin").mkdir(parents=True)
    (venv / "keep-me").write_text("an older venv")
    proc = run_setup(repo, VLLM_PYTHON="python3.99-not-installed")
    assert proc.returncode == 1
    assert "!! vllm venv setup failed: interpreter python3.99-not-installed not found" in proc.stdout
    assert (venv / "keep-me").exists()
    note = repo / ".cache" / "vllm-setup-failed"
    assert "python3.99-not-installed not found" in note.read_text()
    problem = vllm_venv_problem(venv, note)
    assert problem is not None and "python3.99-not-installed not found" in problem


def test_an_up_to_date_venv_is_a_no_op(tmp_path: Path) -> None:
    repo = scratch_repo(tmp_path)
    venv = repo / ".venv-vllm"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(shutil.which("python3") or "/usr/bin/python3")
    digest = hashlib.sha256((repo / LOCK.name).read_bytes()).hexdigest()
    (venv / ".gymbridge-vllm-stamp").write_text(f"{digest} vllm=={VLLM_VERSION}\n")
    proc = run_setup(repo, VLLM_PYTHON="python3.99-not-installed")  # would fail if it built
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "vllm venv up to date" in proc.stdout
    assert vllm_venv_problem(venv, repo / ".cache" / "vllm-setup-failed") is None
