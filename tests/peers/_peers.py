"""Run verl's and TRL's own code from ``.venv-peers`` (built by ``scripts/setup_peers_venv.sh``).

gymbridge never imports verl or TRL: verl 0.9.1 pins ``transformers<5.11`` and both pull in stacks
the project does not need. The peers' functions run in a subprocess of the peers venv
(``tests/peers/peer_objective.py``) on cases passed as JSON, and the tests compare their answers
with gymbridge's. ``GYMBRIDGE_REQUIRE_PEERS=1`` turns the suite's skip (no usable venv) into a
failure.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
PEERS_VENV = Path(os.environ.get("PEERS_VENV", REPO_ROOT / ".venv-peers"))
PEERS_PYTHON = PEERS_VENV / "bin" / "python"
PEERS_STAMP = PEERS_VENV / ".gymbridge-peers-stamp"
SETUP_FAILURE = REPO_ROOT / ".cache" / "peers-setup-failed"
"""Written by scripts/setup_peers_venv.sh when a build fails, removed when one succeeds."""
REQUIRE_PEERS = os.environ.get("GYMBRIDGE_REQUIRE_PEERS") == "1"
VERL_VERSION = "0.9.1"
TRL_VERSION = "1.16.0"
SCRIPT = Path(__file__).with_name("peer_objective.py")
TIMEOUT_S = 900
"""Importing TRL and verl takes ~10 s on an idle 2-core machine (over a minute under load)."""


def peers_venv_problem(venv: Path | None = None, setup_failure: Path | None = None) -> str | None:
    """Why the peers venv cannot be used (naming the fix), or ``None`` when it is ready."""
    venv = PEERS_VENV if venv is None else venv
    setup_failure = SETUP_FAILURE if setup_failure is None else setup_failure
    problem: str | None = None
    if not (venv / "bin" / "python").exists():
        problem = f"{venv} is absent: run `bash scripts/setup_peers_venv.sh` to install verl and TRL"
    else:
        stamp_file = venv / PEERS_STAMP.name
        stamp = stamp_file.read_text().strip() if stamp_file.exists() else ""
        if not stamp.endswith(f"verl=={VERL_VERSION} trl=={TRL_VERSION}"):
            problem = f"{venv} is incomplete (no stamp): rerun `bash scripts/setup_peers_venv.sh`"
    if problem and setup_failure.exists():
        problem += f"; last setup failure: {setup_failure.read_text(errors='replace').strip()[-500:]}"
    return problem


def run_peers(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case's result from the peers' own functions (one subprocess for all of them)."""
    proc = subprocess.run(
        [str(PEERS_PYTHON), str(SCRIPT)],
        input=json.dumps({"cases": cases}),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": "", "VERL_USE_EXTERNAL_PLUGINS": "none"},
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"peer_objective.py failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    out = json.loads(proc.stdout)
    assert out["versions"] == {"trl": TRL_VERSION, "verl": VERL_VERSION}, out["versions"]
    results: list[dict[str, Any]] = out["results"]
    return results
