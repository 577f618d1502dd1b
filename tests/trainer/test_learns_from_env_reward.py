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

The multi-turn variant (configs/smoke_color_tool.yaml: ``reveal: tool``) shows no image in the
prompt: the model calls ``look`` and must name the colour of the image the tool returns at the
second model call. It learns the same way; its controls are the stale turn-0 prompt
(``withhold_later_media``: the generator never sees the tool's image, the trained turns do) and
grey tool images. Together they prove the per-turn media path and the refresh rule end to end.

These take minutes: marked ``slow`` and ``learning``; scripts/test.sh runs ``-m learning`` as
its second pytest invocation, so CI runs them.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from gymbridge.trainer.smoke import DEFAULT_CONFIG, build_config, run_smoke

TOOL_CONFIG = DEFAULT_CONFIG.with_name("smoke_color_tool.yaml")

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


def _rollouts(run_dir: Path, step: int) -> list[dict[str, Any]]:
    lines = (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _looked_and_answered(run_dir: Path, step: int) -> float:
    """Fraction of the step's rollouts that called look and then answered after the tool's image."""
    rows = _rollouts(run_dir, step)
    ok = [r for r in rows if len(r["turns"]) == 2 and r["turns"][1]["media"] and r["turns"][1]["text"]]
    return len(ok) / len(rows)


def test_tool_image_variant_learns_from_env_reward_alone(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = build_config(TOOL_CONFIG, [], {"run_dir": str(run_dir)})
    assert cfg.native and cfg.env_params["reveal"] == "tool" and cfg.max_turns == 2
    out = io.StringIO()
    result = run_smoke(cfg, out=out)
    rewards = result.env_rewards
    assert rewards[0] <= 0.6, out.getvalue()
    assert _mean(rewards[-10:]) >= 0.9, out.getvalue()
    assert result.rollouts_failed == 0
    # the deciding image is the tool's, at the second model call: the trained turn 1 carries it
    assert _looked_and_answered(run_dir, cfg.steps) >= 0.9
    assert all("image" in keys for keys in result.media_keys)


def test_tool_image_withheld_from_the_generator_stays_at_chance(tmp_path: Path) -> None:
    """The stale turn-0 prompt: the trained turns hold the tool's image, the generator's input does not."""
    run_dir = tmp_path / "run"
    overrides: list[tuple[str, Any]] = [("withhold_later_media", True), ("trainer.ratio_tolerance", None)]
    cfg = build_config(TOOL_CONFIG, overrides, {"run_dir": str(run_dir)})
    out = io.StringIO()
    result = run_smoke(cfg, out=out)
    assert "withhold_later_media" in out.getvalue()
    _assert_at_chance(result.env_rewards, out.getvalue())
    assert all("image" in keys for keys in result.media_keys)  # the trainer still got the images
    # the episodes ran (look, then an answer); the image never reached the policy
    assert _looked_and_answered(run_dir, cfg.steps) >= 0.5


def test_tool_images_blanked_stay_at_chance(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = build_config(TOOL_CONFIG, [("env_params.blank", True)], {"run_dir": str(run_dir)})
    out = io.StringIO()
    result = run_smoke(cfg, out=out)
    _assert_at_chance(result.env_rewards, out.getvalue())
    assert _looked_and_answered(run_dir, cfg.steps) >= 0.5


def _assert_at_chance(rewards: list[float], log: str) -> None:
    # every step holds one red and one blue row: an image-blind policy scores at most 0.5 on average
    assert _mean(rewards[-30:]) <= 0.7, log
    assert max(_mean(rewards[i : i + 10]) for i in range(0, len(rewards) - 9)) < 0.9, log
