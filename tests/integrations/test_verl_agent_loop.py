"""verl 0.9.1's real agent-loop post-processing on ``GymAgentLoop``'s output, run inside ``.venv-verl``.

verl pins ``transformers<5.11``, so these tests run ``verl_scripts/agent_loop_postprocess.py`` with the
verl venv's interpreter (``scripts/setup_verl_venv.sh``) and check the measurements it prints. They
skip with the reason when the venv is absent, and fail instead under ``GYMBRIDGE_REQUIRE_VERL=1`` (CI).
verl's PPO trainer itself needs GPUs and vLLM or SGLang; this is the part that runs on CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "verl_scripts" / "agent_loop_postprocess.py"


def _run(verl_python: Path, case: str) -> dict[str, Any]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("PYTHONPATH", None)  # the verl venv imports its own (editable) gymbridge, nothing of .venv's
    proc = subprocess.run(
        [str(verl_python), str(SCRIPT), "--case", case],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


def test_verl_postprocess_turns_a_two_image_multi_turn_rollout_into_a_trainable_batch(
    verl_python: Path,
) -> None:
    r = _run(verl_python, "ok")
    # the loop: look, look, answer; each call was given every image so far (the refresh rule)
    assert [c["images"] for c in r["calls"]] == [0, 1, 2]
    assert len({c["request_id"] for c in r["calls"]}) == 1  # one sticky session per rollout
    assert r["num_images"] == 2 and r["grid_rows"] == 2 and r["gym_failure"] is None
    # verl re-processed the images from the decoded tokens: features and placeholders agree
    assert r["image_tokens"] == r["image_features"] > 0
    assert r["pixel_rows"] == r["grid_patches"]
    # M-RoPE: text positions + 3 rows, and the vision rows are not the text row
    assert r["position_ids_shape"] == [1, 4, r["input_len"]] and r["vision_rows_differ"]
    # the env's /verify reward (the right colour: 1.0) sits on the last response token only
    assert r["reward_score"] == 1.0 and r["rm_value"] == 1.0
    assert r["rm_nonzero"] == [r["last_response_index"]]
    assert r["masked_generated"] == r["generated"]  # response_mask: exactly the generated tokens
    assert r["num_turns"] == 6  # prompt, 3 model calls, 2 tool answers
    # the tiny Qwen2-VL's forward runs on the batch, as verl's actor feeds it
    assert r["logits_shape"][:2] == [1, r["input_len"]] and r["logits_finite"]


def test_verl_loop_refuses_a_processor_verl_could_not_bind_mrope_to(verl_python: Path) -> None:
    """verl binds get_rope_index by class name; any other processor class is dropped with a warning only."""
    r = _run(verl_python, "unbound")
    assert r["error_type"] == "IntegrationError", r
    assert "no processor" in r["error"] and "1-D positions" in r["error"]


def test_a_failed_environment_is_recorded_in_the_batch_and_trains_nothing(verl_python: Path) -> None:
    r = _run(verl_python, "env_down")
    assert r["batch_size"] == 1 and r["calls"] == []  # no model call without a session
    assert r["gym_failure"] and "EnvTransportError" in r["gym_failure"]
    assert r["masked"] == 0 and r["rm_sum"] == 0.0
