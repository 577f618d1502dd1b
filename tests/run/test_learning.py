"""The default smoke and its multi-turn variant learn from the env reward alone; their controls cannot.

``gymbridge smoke run`` as shipped (gymbridge/configs/smoke.yaml: color_pick, format warm-up on
image-independent targets, GRPO, no shaping) must take the env reward from chance to >= 0.9.
The control runs the same config with every image painted grey (the answer is still the
row's colour): the reward must stay at chance, so the rise above is the image reaching the
policy (per-turn media, placeholders, refresh and dedup all right), not the warm-up.

The multi-turn variant (gymbridge/configs/smoke_color_tool.yaml) shows no image in the prompt: the
colour arrives as the ``look`` tool's image at the second model call. It must learn the same way,
and stay at chance under two controls: grey tool images, and a deliberately stale turn-0 prompt
(``rollout.withhold_later_media``: the generator never sees the tool's image, the trained turns do). Those
are the end-to-end proof that per-turn media, the refresh rule and deduplication line up: an image
that does not reach the turn it decides cannot be learned from.

The default smoke's test runs exactly what a user runs: the shipped config on the Gym path (HTTP to
the agent and the model server) at the machine's default torch threads. There the rollout order
within a group follows HTTP arrival and the thread count changes the order of float reductions,
so no two runs are bit-identical: the test asserts the reward over the last 10 steps >= 0.8
(docs/benchmarks.md, "Learning robustness": on the row-seeded sampler 20 of 20 runs, seeds 0-9 at
default threads and at one thread, ended >= 0.9, the worst at 0.956).

The controls and the multi-turn variant run with ``rollout.native: true`` and one torch thread
(``one_torch_thread``): every rollout's sampling seed is derived from ``(seed, task, rollout
index)`` and each row samples from its own stream, so a rerun draws the same tokens alone, on a
pytest-xdist worker, or on a machine with more cores; the rows share forward passes in batches
their arrival makes, so logprobs agree to float rounding (a near-tie could still flip a token).

Step 1 comes before any update, after the warm-up: its 16 rollouts sample a policy that has seen
no reward yet, so its reward is about chance, 0.5 give or take the draw (a fair coin gives 10 or
more of 16 about 23% of the time). The tests bound it at 0.7 (11 of 16), and check the policy
itself: each answer word's sampler probability at step 1 is the same whatever the image (within
0.05; measured: red 0.52 / 0.53 and blue 0.44 / 0.43 for the two images with the smoke's linear
warm-up lr). A warm-up that leaked the answers would fail both.

These take minutes: marked ``slow`` and ``learning``. scripts/test.sh runs all five after the
default tests, on 2 pytest-xdist workers, so CI runs them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from run_helpers import quiet_train

from gymbridge.run import load_run_config
from gymbridge.testing.trl_format import one_torch_thread as torch_threads_one

pytestmark = [
    pytest.mark.slow,
    pytest.mark.learning,
    pytest.mark.timeout(1800),  # a hang guard: ~110 s alone, 196 s in CI, 1000 s at load average 24
]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _assert_step1_blind_to_the_image(run_dir: Path) -> None:
    """Before any update the policy answers alike whatever the image: each answer word's sampler
    probability (``rollouts/step_1.jsonl``) is the same in every group that sampled it."""
    probs: dict[str, dict[int, float]] = {}  # word -> group (one image each) -> probability
    for line in (run_dir / "rollouts" / "step_1.jsonl").read_text().splitlines():
        rollout = json.loads(line)
        turn = rollout["turns"][-1]
        word = turn["text"].replace("<|im_end|>", "")
        probs.setdefault(word, {})[rollout["group"]] = math.exp(turn["generation_logprobs"][0])
    shared = {w: list(by_group.values()) for w, by_group in probs.items() if len(by_group) > 1}
    assert shared, probs  # some word was sampled for both images
    for word, ps in shared.items():
        assert max(ps) - min(ps) <= 0.05, (word, ps)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    with torch_threads_one():
        yield


def test_default_smoke_learns_from_env_reward_alone(tmp_path: Path) -> None:
    """The shipped default as a user runs it: the Gym path, the machine's default threads."""
    cfg = load_run_config(["smoke"], [], {"run_dir": str(tmp_path / "run")})
    assert cfg.shaping.kind == "none" and cfg.env.name == "color_pick" and not cfg.rollout.native
    result, log = quiet_train(cfg)
    rewards = result.env_rewards
    assert len(rewards) == cfg.steps
    assert rewards[0] <= 0.7, log  # about chance after the format warm-up (module docstring)
    _assert_step1_blind_to_the_image(tmp_path / "run")
    assert _mean(rewards[-10:]) >= 0.8, log
    assert result.shaping_rewards == [0.0] * cfg.steps
    assert result.rollouts_failed == 0
    assert (tmp_path / "run" / "charts" / "env_reward.png").is_file()


def test_lora_smoke_learns_training_only_its_adapters_and_head(tmp_path: Path) -> None:
    """``--config smoke_lora``: rank-8 adapters on the decoder and the head in full (docs/run.md, *LoRA*)
    learn the image's colour from the env reward; every publication carries only those tensors."""
    cfg = load_run_config(["smoke_lora"], [], {"run_dir": str(tmp_path / "run")})
    assert cfg.trainer.lora.rank == 8
    result, log = quiet_train(cfg)
    rewards = result.env_rewards
    assert len(rewards) == cfg.steps
    assert rewards[0] <= 0.7, log
    assert _mean(rewards[-10:]) >= 0.8, log
    sent = {r["weight_sync_bytes"] for r in result.records if r["published"]}
    assert sent == {4 * (16_384 + 32_768)}, sent  # fp32 adapters and lm_head, nothing of the base


@pytest.mark.usefixtures("one_torch_thread")
def test_blanked_images_stay_at_chance(tmp_path: Path) -> None:
    cfg = load_run_config(
        ["smoke"], [("env.params.blank", True)], {"run_dir": str(tmp_path / "run"), "native": True}
    )
    result, log = quiet_train(cfg)
    rewards = result.env_rewards
    # every step holds one red and one blue row: an image-blind policy scores 0.5 per step on average
    assert 0.3 <= _mean(rewards[-30:]) <= 0.7, log
    assert max(_mean(rewards[i : i + 10]) for i in range(0, len(rewards) - 9)) < 0.9, log


# ---- the multi-turn variant: the deciding image comes from the look tool at the second model call

TOOL_CONFIG = "smoke_color_tool"


def _tool_run(tmp_path: Path, overrides: list[tuple[str, object]]) -> tuple[list[float], str]:
    cfg = load_run_config([TOOL_CONFIG], overrides, {"run_dir": str(tmp_path / "run")})
    assert cfg.env.params["reveal"] == "tool" and cfg.rollout.max_turns == 2 and cfg.shaping.kind == "none"
    result, log = quiet_train(cfg)
    assert len(result.env_rewards) == cfg.steps
    assert result.rollouts_failed == 0, log
    assert result.shaping_rewards == [0.0] * cfg.steps
    return result.env_rewards, log


@pytest.mark.usefixtures("one_torch_thread")
def test_tool_image_variant_learns_from_env_reward_alone(tmp_path: Path) -> None:
    rewards, log = _tool_run(tmp_path, [])
    # the warm-up taught the answer only: the forced look call is never sampled
    assert "(160 of the forced first call left out)" in log, log
    assert rewards[0] <= 0.7, log  # about chance (module docstring)
    _assert_step1_blind_to_the_image(tmp_path / "run")
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
    rewards, log = _tool_run(tmp_path, [("env.params.blank", True)])
    assert 0.3 <= _mean(rewards[-30:]) <= 0.7, log
    assert max(_mean(rewards[i : i + 10]) for i in range(0, len(rewards) - 9)) < 0.9, log


@pytest.mark.usefixtures("one_torch_thread")
def test_tool_variant_stale_turn0_prompt_stays_at_chance(tmp_path: Path) -> None:
    """The generator's input keeps the turn-0 prompt's media only (the tool's image withheld).

    The trained turns still carry the image, so the trainer's logprobs differ from the sampler's:
    the drift guard is off (``ratio_tolerance=null``) for this control alone.
    """
    rewards, log = _tool_run(
        tmp_path, [("rollout.withhold_later_media", True), ("trainer.ratio_tolerance", None)]
    )
    assert "withhold_later_media" in log
    assert 0.3 <= _mean(rewards[-30:]) <= 0.7, log
    assert max(_mean(rewards[i : i + 10]) for i in range(0, len(rewards) - 9)) < 0.9, log
