"""Run verl's and TRL's own code from ``.venv-verl`` (built by ``scripts/setup_verl_venv.sh``).

gymbridge never imports verl or TRL here: verl 0.9.1 pins ``transformers<5.11``, so its venv is
separate, and the same venv holds TRL 1.16.0 (its lock adds it). The peers' functions run in a
subprocess of that venv (``tests/peers/peer_objective.py``) on cases passed as JSON, and the tests
compare their answers with gymbridge's. The interpreter comes from the root conftest's
``verl_python`` fixture: skipped with the fix named when the venv is unusable, a failure under
``GYMBRIDGE_REQUIRE_VERL=1`` (CI).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
VERL_VERSION = "0.9.1"
TRL_VERSION = "1.16.0"
SCRIPT = Path(__file__).with_name("peer_objective.py")
TIMEOUT_S = 900
"""Importing TRL and verl takes ~10 s on an idle 2-core machine (over a minute under load)."""


def run_peers(python: Path, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case's result from the peers' own functions (one subprocess of ``python`` for all)."""
    proc = subprocess.run(
        [str(python), str(SCRIPT)],
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
