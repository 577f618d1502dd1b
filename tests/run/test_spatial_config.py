"""``gymbridge train --config smoke_spatial``: side_pick through the user's command, its blank control.

The learning curve itself is measured in docs/benchmarks.md ("The spatial task (issue 24)"); here the command
runs 2 steps end to end with the blank-image control (``--set env.params.blank=true``) and the
objective options of docs/grpo.md set the way a user sets them (``--set trainer.X=...``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gymbridge.cli import main
from gymbridge.media import MediaItem
from gymbridge.run import RunConfig, load_run_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_the_spatial_config_is_side_pick_over_the_smoke() -> None:
    cfg = load_run_config(["smoke_spatial"])
    smoke = load_run_config(["smoke"])
    assert (cfg.env.name, cfg.bridge.prompts_per_step) == ("side_pick", 4)
    assert cfg.warmup == smoke.warmup and cfg.shaping.kind == "none"
    # the smoke's trainer, with the KL anchor to the warmed-up policy, over 300 steps (docs/benchmarks.md)
    assert cfg.trainer == smoke.trainer.model_copy(update={"kl_coef": 0.05, "lr_decay_steps": 300})
    assert (cfg.steps, cfg.bridge.advantage) == (300, "group_norm")
    blank = load_run_config(["smoke_spatial"], [("env.params.blank", True)])
    assert blank.env.params == {"blank": True}


def test_smoke_spatial_trains_two_steps_with_its_blank_control_and_the_objective_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    code = main(
        [
            "train", "--config", "smoke_spatial",
            "--steps", "2",
            "--set", "env.params.blank=true",
            "--set", "warmup.steps=2",
            "--set", "trainer.clip_ratio_c=3",
            "--set", "trainer.kl_coef=0.01",
            "--set", "trainer.kl_estimator=low_var_kl",
            "--set", "trainer.kl_bias_correction=true",
            "--set", "trainer.entropy_coef=0.01",
            "--run-dir", str(run_dir),
            "--no-progress",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["rollouts_ok"] == 4 * 8 and r["rollouts_failed"] == 0 for r in records)
    assert all(0.0 <= r["dual_clip_fraction"] <= 1.0 for r in records)
    # the entropy bonus's token mean reaches metrics.jsonl and the step line (a few tokens' entropy
    # over the tiny vocabulary: above 0, below log(vocabulary))
    assert all(0.0 < r["entropy"] < 10.0 for r in records)
    assert [line for line in out.splitlines() if line.startswith("step ") and "  entropy " in line], out
    cfg = RunConfig.model_validate(yaml.safe_load((run_dir / "config.yaml").read_text()))
    assert cfg.env.name == "side_pick" and cfg.env.params == {"blank": True}
    assert (cfg.trainer.clip_ratio_c, cfg.trainer.kl_estimator, cfg.trainer.kl_bias_correction) == (
        3.0,
        "low_var_kl",
        True,
    )
    assert cfg.trainer.entropy_coef == 0.01
    # the control: the rows trained on keep their answers, and their images show no bar
    rows = [json.loads(line) for line in (run_dir / "dataset.jsonl").read_text().splitlines()]
    assert {r["side"] for r in rows} == {"T", "B", "L", "R"} and all(r["blank"] for r in rows)
    url = rows[0]["responses_create_params"]["input"][0]["content"][0]["image_url"]
    assert MediaItem.from_ref(url, "image").image().getcolors() == [(168 * 168, (255, 255, 255))]
