"""Run scripts inside ``.venv-vllm`` (real vLLM, ``scripts/setup_vllm_venv.sh``) from the main pytest.

Role: the launcher behind the ``vllm`` conformance suite. gymbridge's own venv never has vLLM; each
test runs one script of ``tests/vllm/scripts/`` with the vLLM venv's interpreter, the repository
on ``PYTHONPATH`` (so the script imports this checkout's gymbridge beside the real vLLM), in a
scratch working directory, and reads the JSON object the script prints as its last stdout line.

Invariants:
* a script that exits non-zero fails the test with its stderr tail (a conformance regression is
  never a skip); only an absent or unstamped venv skips, quoting the last setup failure, and
  ``GYMBRIDGE_REQUIRE_VLLM=1`` turns that skip into a failure;
* the child sees no GPU (``CUDA_VISIBLE_DEVICES=""``): the CUDA wheel then runs on vLLM's
  "unspecified" platform, so scripts that build vLLM configs pass ``DeviceConfig(device="cpu")``
  (vLLM's CPU platform would bind custom ops only its CPU wheel has). Hugging Face is offline,
  usage stats are off, temp files go to the test's ``tmp_path``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = Path(os.environ.get("VLLM_VENV", REPO_ROOT / ".venv-vllm"))
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
VLLM_STAMP = VLLM_VENV / ".gymbridge-vllm-stamp"
SETUP_FAILURE = REPO_ROOT / ".cache" / "vllm-setup-failed"
REQUIRE_VLLM = os.environ.get("GYMBRIDGE_REQUIRE_VLLM") == "1"
VLLM_VERSION = "0.33.0"
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def vllm_venv_problem(venv: Path | None = None, setup_failure: Path | None = None) -> str | None:
    """Why the vLLM venv cannot be used, or ``None`` when it is ready (the reason names the fix)."""
    venv = VLLM_VENV if venv is None else venv
    setup_failure = SETUP_FAILURE if setup_failure is None else setup_failure
    problem: str | None = None
    if not (venv / "bin" / "python").exists():
        problem = f"{venv} is absent: run `bash scripts/setup_vllm_venv.sh` to build real vLLM {VLLM_VERSION}"
    else:
        stamp_file = venv / VLLM_STAMP.name
        stamp = stamp_file.read_text().strip() if stamp_file.exists() else ""
        if not stamp.endswith(f"vllm=={VLLM_VERSION}"):
            problem = (
                f"{venv} is incomplete (no stamp for vllm=={VLLM_VERSION}): "
                "rerun `bash scripts/setup_vllm_venv.sh`"
            )
    if problem and setup_failure.exists():
        problem += f"; last setup failure: {setup_failure.read_text(errors='replace').strip()[-500:]}"
    return problem


def run_script(name: str, *args: str, cwd: Path, timeout_s: float = 1200) -> Any:
    """Run ``scripts/<name>`` in the vLLM venv; return the JSON its last stdout line holds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(
        PYTHONPATH=str(REPO_ROOT),
        CUDA_VISIBLE_DEVICES="",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        TMPDIR=str(cwd),
        OMP_NUM_THREADS="1",
    )
    proc = subprocess.run(
        [str(VLLM_PYTHON), str(SCRIPTS / name), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise AssertionError(
            f"{name} failed in {VLLM_VENV} (exit {proc.returncode}):\n"
            f"{proc.stderr[-4000:]}\n{proc.stdout[-2000:]}"
        )
    return json.loads(lines[-1])
