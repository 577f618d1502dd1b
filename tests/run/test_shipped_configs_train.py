"""Every shipped config and every image / text example environment trains: nonzero gradients, no failures.

Regression: ``smoke_ray.yaml`` and ``smoke_zoom_read.yaml`` (gymbridge/configs/) printed ``grad_norm
0.0000`` at every step, and ``--env counter`` (and the others) died on circle_click's
``img_size`` parameter. Each run is cut to 2 steps and 16 tokens. ``beep_count`` / ``bouncing_ball``
need a model that takes audio / video (the tiny Qwen2-VL takes images only): tests/run/test_run_e2e.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from run_helpers import quiet_train

from gymbridge.run import RunSummary, load_run_config
from gymbridge.run.config import CONFIGS_DIR

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

CONFIGS = sorted(CONFIGS_DIR.glob("*.yaml"))


def _trains(result: RunSummary) -> None:
    assert len(result.steps) == 2
    assert any(m.grad_norm > 0 for m in result.steps), [m.grad_norm for m in result.steps]
    assert result.rollouts_failed == 0


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_trains_with_nonzero_gradients(path: Path, tmp_path: Path) -> None:
    cfg = load_run_config([path.stem], [("steps", 2)], {"run_dir": str(tmp_path / "run")})
    _trains(quiet_train(cfg)[0])


@pytest.mark.parametrize("env", ["color_pick", "circle_click", "zoom_read", "counter", "grid_door"])
def test_every_image_and_text_env_trains_with_toy_shaping_and_skips_honestly_without(
    env: str, tmp_path: Path
) -> None:
    """With the opt-in toy shaping every env trains; without it, an env the random model never
    solves gives zero-advantage batches, and the run says so instead of stepping AdamW on nothing."""
    from gymbridge_envs import get_env

    # 16 tokens keep the runs short (the random tiny model rarely stops by itself); that each environment
    # gets its own budget, not the colour toy's 4, is tests/run/test_regression_run_config_rules.py's test
    sets = [("steps", 2), ("env.params", get_env(env).smoke_params), ("rollout.max_tokens", 16)]
    shaped = load_run_config(
        ["smoke"], [*sets, ("shaping.kind", "token_rate")], {"env": env, "run_dir": str(tmp_path / "a")}
    )
    _trains(quiet_train(shaped)[0])
    if env == "color_pick":
        return  # its format warm-up makes the env reward itself vary
    plain = load_run_config(["smoke"], sets, {"env": env, "run_dir": str(tmp_path / "b")})
    result, text = quiet_train(plain)
    assert result.rollouts_failed == 0 and all(e == 0.0 for e in result.env_rewards)
    assert all(m.skipped == "zero_advantage" and m.grad_norm == 0 for m in result.steps)
    assert "skipped (zero advantage: no update, v0 kept)" in text and "2 skipped: no learning signal" in text
