"""The trainer's learning-rate schedule (``GRPOConfig.lr_warmup_steps`` / ``lr_schedule``): values, the
optimizer it drives, a resumed run continuing it, and the launcher showing it in ``metrics.jsonl``."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from trainer_helpers import make_batch, with_current_logprobs

from gymbridge.cli import main as cli_main
from gymbridge.errors import ConfigError
from gymbridge.models.tiny_vlm import TinyVLM
from gymbridge.run import load_run_config
from gymbridge.trainer import GRPOConfig, GRPOTrainer, tiny_policy
from gymbridge.trainer.checkpoint import load_checkpoint, save_checkpoint


def test_warmup_then_cosine_values() -> None:
    cfg = GRPOConfig(lr=1e-2, lr_warmup_steps=4, lr_schedule="cosine", lr_decay_steps=12, lr_min_ratio=0.1)
    assert [cfg.lr_at(k) for k in (1, 2, 4)] == pytest.approx([2.5e-3, 5e-3, 1e-2])
    assert cfg.lr_at(8) == pytest.approx(1e-2 * (0.1 + 0.9 * 0.5))  # half way: cos(pi/2) = 0
    assert cfg.lr_at(12) == pytest.approx(1e-3) and cfg.lr_at(50) == pytest.approx(1e-3)  # the floor
    # no warm-up: the decay starts from lr at update 0, so update k is k / D of the way down
    linear = GRPOConfig(lr=1e-2, lr_schedule="linear", lr_decay_steps=10)
    assert [linear.lr_at(k) for k in (1, 5, 10)] == pytest.approx([9e-3, 5e-3, 0.0])
    assert GRPOConfig(lr=3e-3).lr_at(1000) == 3e-3 and not GRPOConfig().lr_scheduled
    with pytest.raises(ValueError, match="counted from 1"):
        cfg.lr_at(0)


def test_a_run_shorter_than_its_warmup_never_decays() -> None:
    cfg = GRPOConfig(lr=1e-2, lr_warmup_steps=10, lr_schedule="cosine", lr_decay_steps=3, lr_min_ratio=0.5)
    assert [cfg.lr_at(k) for k in (1, 3, 10)] == pytest.approx([1e-3, 3e-3, 1e-2])
    assert cfg.lr_at(11) == pytest.approx(5e-3)


def test_a_decay_without_a_horizon_is_refused() -> None:
    with pytest.raises(ValidationError, match="needs lr_decay_steps >= 1"):
        GRPOConfig(lr_schedule="cosine")
    with pytest.raises(ConfigError, match="lr_decay_steps"):
        load_run_config(["smoke"], [("trainer.lr_decay_steps", 0)])


@settings(max_examples=200, deadline=None)
@given(
    lr=st.floats(1e-6, 1.0),
    warm=st.integers(0, 20),
    decay=st.integers(1, 200),
    floor=st.floats(0.0, 1.0),
    schedule=st.sampled_from(["constant", "linear", "cosine"]),
)
def test_the_schedule_rises_then_falls_within_its_bounds(
    lr: float, warm: int, decay: int, floor: float, schedule: Any
) -> None:
    cfg = GRPOConfig(
        lr=lr, lr_warmup_steps=warm, lr_schedule=schedule, lr_decay_steps=decay, lr_min_ratio=floor
    )
    values = [cfg.lr_at(k) for k in range(1, max(warm, decay) + 5)]
    bottom = lr * floor if schedule != "constant" else lr
    assert all(0 < v <= lr * (1 + 1e-12) for v in values[:warm])
    assert all(min(bottom, lr) * (1 - 1e-9) <= v <= lr * (1 + 1e-12) for v in values[warm:])
    rising, falling = values[:warm], values[warm:]
    assert all(a < b for a, b in itertools.pairwise(rising))
    assert all(b <= a * (1 + 1e-12) for a, b in itertools.pairwise(falling))
    if warm:
        assert math.isclose(values[warm - 1], lr)


def test_the_trainer_steps_the_optimizer_at_the_scheduled_lr(tiny: TinyVLM) -> None:
    model = tiny_policy(0)
    batch = with_current_logprobs(model, make_batch(tiny))
    cfg = GRPOConfig(lr=1e-3, lr_warmup_steps=2, lr_schedule="linear", lr_decay_steps=4)
    trainer = GRPOTrainer(model, cfg, on_policy=False)
    seen = []
    for _ in range(4):
        m = trainer.step(batch)
        seen.append((m.lr, trainer.optimizer.param_groups[0]["lr"]))
    assert [a for a, _ in seen] == pytest.approx([5e-4, 1e-3, 5e-4, 0.0])
    assert [a for a, _ in seen] == [b for _, b in seen]  # what the metrics say is what stepped


def test_no_schedule_leaves_a_callers_optimizer_alone(tiny: TinyVLM) -> None:
    model = tiny_policy(0)
    batch = with_current_logprobs(model, make_batch(tiny))
    opt = torch.optim.SGD(model.parameters(), lr=0.123)
    GRPOTrainer(model, GRPOConfig(lr=1e-3), optimizer=opt, on_policy=False).step(batch)
    assert opt.param_groups[0]["lr"] == 0.123


def test_a_resumed_trainer_continues_the_schedule(tiny: TinyVLM, tmp_path: Path) -> None:
    cfg = GRPOConfig(lr=1e-3, lr_warmup_steps=4)
    model = tiny_policy(0)
    batch = with_current_logprobs(model, make_batch(tiny))
    trainer = GRPOTrainer(model, cfg, on_policy=False)
    trainer.step(batch)
    trainer.step(batch)
    save_checkpoint(tmp_path, step=2, policy_version=2, trainer=trainer, done_task_indices=[])
    fresh = GRPOTrainer(tiny_policy(0), cfg, on_policy=False)
    load_checkpoint(tmp_path, trainer=fresh)
    assert fresh.step(batch).lr == pytest.approx(7.5e-4)  # update 3 of the warm-up, not update 1


@pytest.mark.integration
def test_the_lr_schedule_from_the_launcher_lands_in_metrics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--set trainer.lr_warmup_steps=2``; the decay horizon (``lr_decay_steps``) follows ``--steps``."""
    run = tmp_path / "run"
    argv = ["smoke", "run", "--native", "--steps", "4", "--prompts", "1", "--group-size", "4"]
    argv += ["--no-progress"]
    argv += ["--run-dir", str(run), "--set", "trainer.lr_warmup_steps=2", "--set", "trainer.lr=1e-3"]
    argv += ["--set", "warmup.steps=0", "--set", "shaping.kind=token_rate", "--set", "rollout.max_tokens=16"]
    assert cli_main(argv) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # warm-up 1e-3 * k / 2, then cosine from 1e-3 to the overlay's floor (10 %) at the last (4th) update;
    # a skipped step (no reward variance) takes no update, so the schedule waits for it
    want = [5e-4, 1e-3, 1e-3 * (0.1 + 0.9 * 0.5), 1e-4]
    trained = [r["lr"] for r in records if r["skipped"] is None]
    assert trained and trained == pytest.approx(want[: len(trained)])
    assert all(r["lr"] == 0.0 for r in records if r["skipped"] is not None)
    assert "  lr 5.00e-04" in capsys.readouterr().out


def test_adam_eps_is_the_optimizers_and_must_be_positive(tiny: TinyVLM) -> None:
    """``trainer.adam_eps`` reaches AdamW; a weight whose gradients stay far below it barely moves."""
    model = tiny_policy(0)
    batch = with_current_logprobs(model, make_batch(tiny))
    moved = {}
    for eps in (1e-8, 1e-2):
        policy = tiny_policy(0)
        trainer = GRPOTrainer(policy, GRPOConfig(lr=1e-3, adam_eps=eps), on_policy=False)
        assert trainer.optimizer.param_groups[0]["eps"] == eps
        before = [p.detach().clone() for p in trainer.params]
        trainer.step(batch)
        pairs = zip(trainer.params, before, strict=True)
        steps = torch.cat([(p.detach() - b).abs().flatten() for p, b in pairs])
        moved[eps] = (float(steps.max()), float(steps.mean()))
    assert moved[1e-8][0] == pytest.approx(1e-3, rel=0.05)  # Adam's 1st step: about lr, whatever the gradient
    assert moved[1e-2][1] < 0.1 * moved[1e-8][1]  # on average: most gradients are far below 1e-2
    for bad in (0.0, -1e-8, float("nan")):
        with pytest.raises(ValidationError):
            GRPOConfig(adam_eps=bad)
