"""gymbridge/configs/smoke_zoom_read.yaml is multi-turn: trained turns after turn 0 carry the tool's crops.

Regression: the zoom_read variant made one model call per rollout (the random tiny model never
emits a zoom call), so no tool image ever reached training. The config forces the first call to
a zoom of the whole canvas (``force_first_call``); the crop must then be in the second model
call's turn of the trained rollouts (``rollouts/step_N.jsonl``) and in the step's TrainBatch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from run_helpers import quiet_train

from gymbridge.run import load_run_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_zoom_read_trains_on_tool_images_after_turn_0(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = load_run_config(["smoke_zoom_read"], [], {"run_dir": str(run_dir)})
    result, text = quiet_train(cfg)
    assert result.rollouts_failed == 0, text
    for step in range(1, cfg.steps + 1):
        lines = (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()
        rollouts = [json.loads(line) for line in lines if line.strip()]
        trained = [r for r in rollouts if not r["mask_sample"]]
        assert trained
        for r in trained:
            first, *later = r["turns"]
            assert first["text"].startswith("<tool_call>") and "zoom" in first["text"]
            assert later and later[0]["media"], r  # the crop, at the second model call
            assert later[0]["media"][0]["modality"] == "image"
        assert "image" in result.media_keys[step - 1]  # the step's TrainBatch carried image tensors
    assert all(m.grad_norm > 0 for m in result.steps)
