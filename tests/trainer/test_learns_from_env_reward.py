"""The default smoke learns from the environment's reward alone; with the images blanked it cannot.

``gymbridge smoke run`` as shipped (configs/smoke.yaml: color_pick, format warm-up on
image-independent targets, GRPO, no shaping) must take the env reward from chance to >= 0.9.
The control runs the same config with every image painted grey (the answer is still the
row's colour): the reward must stay at chance, so the rise above is the image reaching the
policy (per-turn media, placeholders, refresh and dedup all right), not the warm-up.

Both run the shipped config with ``native: true``: the same loop, trainer, warm-up and
environment, with rollouts driven in process, which makes a run bit-reproducible (every
rollout's sampling seed is derived from ``(seed, task, rollout index)``). On the Gym path the
rollout order within a group follows HTTP arrival, so reruns differ in float rounding and,
now and then, in the samples drawn; a learning curve that depends on that is not a test that
can fail only for a reason (the README reports the Gym path's own runs).

These take minutes: marked ``slow`` and ``learning``; scripts/test.sh runs ``-m learning`` as
its second pytest invocation, so CI runs them.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from gymbridge.trainer.smoke import build_config, run_smoke

pytestmark = [pytest.mark.slow, pytest.mark.learning, pytest.mark.timeout(900)]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def test_default_smoke_learns_from_env_reward_alone(tmp_path: Path) -> None:
    cfg = build_config(None, [], {"run_dir": str(tmp_path / "run"), "native": True})
    assert cfg.shaping.kind == "none" and cfg.env == "color_pick"
    out = io.StringIO()
    result = run_smoke(cfg, out=out)
    rewards = result.env_rewards
    assert len(rewards) == cfg.steps
    assert rewards[0] <= 0.6, out.getvalue()  # chance after the format warm-up
    assert _mean(rewards[-10:]) >= 0.9, out.getvalue()
    assert result.shaping_rewards == [0.0] * cfg.steps
    assert result.rollouts_failed == 0
    assert result.elapsed_s <= 180, f"the default smoke took {result.elapsed_s:.0f}s (budget: 3 minutes)"
    assert (tmp_path / "run" / "charts" / "env_reward.png").is_file()


def test_blanked_images_stay_at_chance(tmp_path: Path) -> None:
    cfg = build_config(None, [("env_params.blank", True)], {"run_dir": str(tmp_path / "run"), "native": True})
    out = io.StringIO()
    result = run_smoke(cfg, out=out)
    rewards = result.env_rewards
    # every step holds one red and one blue row: an image-blind policy scores 0.5 per step on average
    assert 0.3 <= _mean(rewards[-30:]) <= 0.7, out.getvalue()
    assert max(_mean(rewards[i : i + 10]) for i in range(0, len(rewards) - 9)) < 0.9, out.getvalue()
