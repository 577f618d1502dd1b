"""Every shipped config and every image / text example environment trains: nonzero gradients, no failures.

Regression: ``smoke_ray.yaml`` and ``smoke_zoom_read.yaml`` (gymbridge/configs/) printed ``grad_norm
0.0000`` at every step, and ``--env counter`` (and the others) died on circle_click's
``img_size`` parameter. Each run is cut to 2 steps. ``beep_count`` / ``bouncing_ball`` need a
model that takes audio / video (the tiny Qwen2-VL takes images only), so they are not here.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from gymbridge.launch.smoke import CONFIGS_DIR, build_config, run_smoke

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

CONFIGS = sorted(CONFIGS_DIR.glob("*.yaml"))


def _trains(result: object) -> None:
    steps = result.steps  # type: ignore[attr-defined]
    assert len(steps) == 2
    assert any(m.grad_norm > 0 for m in steps), [m.grad_norm for m in steps]
    assert result.rollouts_failed == 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_trains_with_nonzero_gradients(path: Path, tmp_path: Path) -> None:
    cfg = build_config(path, [("steps", 2)], {"run_dir": str(tmp_path / "run")})
    _trains(run_smoke(cfg, out=io.StringIO()))


@pytest.mark.parametrize("env", ["color_pick", "circle_click", "zoom_read", "counter", "grid_door"])
def test_every_image_and_text_env_trains_with_its_own_defaults(env: str, tmp_path: Path) -> None:
    cfg = build_config(None, [("steps", 2)], {"env": env, "run_dir": str(tmp_path / "run")})
    _trains(run_smoke(cfg, out=io.StringIO()))
