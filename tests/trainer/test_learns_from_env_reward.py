"""The default smoke and its multi-turn variant learn from the env reward alone; their controls cannot.

``gymbridge smoke run`` as shipped (gymbridge/configs/smoke.yaml: color_pick, format warm-up on
image-independent targets, GRPO, no shaping) must take the env reward from chance to >= 0.9.
The control runs the same config with every image painted grey (the answer is still the
row's colour): the reward must stay at chance, so the rise above is the image reaching the
policy (per-turn media, placeholders, refresh and dedup all right), not the warm-up.

The multi-turn variant (gymbridge/configs/smoke_color_tool.yaml) shows no image in the prompt: the
colour arrives as the ``look`` tool's image at the second model call. It must learn the same way,
and stay at chance under two controls: grey tool images, and a deliberately stale turn-0 prompt
(``withhold_later_media``: the generator never sees the tool's image, the trained turns do). Those
are the end-to-end proof that per-turn media, the refresh rule and deduplication line up: an image
that does not reach the turn it decides cannot be learned from.

All of them run the shipped config with ``native: true``: the same loop, trainer, warm-up and
environment, with rollouts driven in process, which makes a run bit-reproducible (every
rollout's sampling seed is derived from ``(seed, task, rollout index)``). On the Gym path the
rollout order within a group follows HTTP arrival, so reruns differ in float rounding and,
now and then, in the samples drawn; a learning curve that depends on that is not a test that
can fail only for a reason (the README reports the Gym path's own runs).

A native run is bit-reproducible for a given torch thread count (the count changes the order of
float reductions, and a learning curve follows its rounding). The multi-turn variant's learning
curve is not robust to that: measured with 2 threads it learned on seeds 0 and 1, with 1 thread it
stayed at chance in all 3 runs (README, "The multi-turn variant learns too"). Its learning test
therefore pins the 2 threads it was measured with (``two_torch_threads``); the controls pin one
(``one_torch_thread``: they cannot learn, whatever the rounding), so they give the same numbers
alone or on a pytest-xdist worker. The default run keeps the machine's default threads (it learned
on 10 of 10 seeds), since its 3-minute budget is a user's run.

These take minutes: marked ``slow`` and ``learning``. scripts/test.sh runs them after the default
tests: the default run alone (its budget), then the multi-turn variant and the controls on 2
workers, so CI runs them.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gymbridge.launch.smoke import build_config, run_smoke

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


# ---- the multi-turn variant: the deciding image comes from the look tool at the second model call

TOOL_CONFIG = "smoke_color_tool"


def _torch_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    yield from _torch_threads(1)


@pytest.fixture
def two_torch_threads() -> Iterator[None]:
    yield from _torch_threads(2)


def _tool_run(tmp_path: Path, overrides: list[tuple[str, object]]) -> tuple[list[float], str]:
    cfg = build_config(TOOL_CONFIG, overrides, {"run_dir": str(tmp_path / "run")})
    assert cfg.env_params["reveal"] == "tool" and cfg.max_turns == 2 and cfg.shaping.kind == "none"
    out = io.StringIO()
    result = run_smoke(cfg, out=out)
    assert len(result.env_rewards) == cfg.steps
    assert result.rollouts_failed == 0, out.getvalue()
    assert result.shaping_rewards == [0.0] * cfg.steps
    return result.env_rewards, out.getvalue()


@pytest.mark.usefixtures("two_torch_threads")
def test_tool_image_variant_learns_from_env_reward_alone(tmp_path: Path) -> None:
    rewards, log = _tool_run(tmp_path, [])
    assert rewards[0] <= 0.6, log
    assert _mean(rewards[-10:]) >= 0.9, log
    # multi-turn for real: every trained rollout's answer is its second model call, and that turn
    # carries the tool's image (the prompt has none)
    lines = (tmp_path / "run" / "rollouts" / "step_1.jsonl").read_text().splitlines()
    for rollout in (json.loads(line) for line in lines if line.strip()):
        first, second = rollout["turns"]
        assert "look" in first["text"] and not first["media"]
        assert [m["modality"] for m in second["media"]] == ["image"]


@pytest.mark.usefixtures("one_torch_thread")
def test_tool_variant_blanked_images_stay_at_chance(tmp_path: Path) -> None:
    rewards, log = _tool_run(tmp_path, [("env_params.blank", True)])
    assert 0.3 <= _mean(rewards[-30:]) <= 0.7, log
    assert max(_mean(rewards[i : i + 10]) for i in range(0, len(rewards) - 9)) < 0.9, log


@pytest.mark.usefixtures("one_torch_thread")
def test_tool_variant_stale_turn0_prompt_stays_at_chance(tmp_path: Path) -> None:
    """The generator's input keeps the turn-0 prompt's media only (the tool's image withheld).

    The trained turns still carry the image, so the trainer's logprobs differ from the sampler's:
    the drift guard is off (``ratio_tolerance=null``) for this control alone.
    """
    rewards, log = _tool_run(tmp_path, [("withhold_later_media", True), ("trainer.ratio_tolerance", None)])
    assert "withhold_later_media" in log
    assert 0.3 <= _mean(rewards[-30:]) <= 0.7, log
    assert max(_mean(rewards[i : i + 10]) for i in range(0, len(rewards) - 9)) < 0.9, log
