"""``gymbridge smoke run`` and its run directory: config, metrics, failures, checkpoints, staleness."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from gymbridge.launch import smoke
from gymbridge.launch.smoke import SmokeConfig

pytestmark = pytest.mark.integration

SMALL = ["--native", "--prompts", "1", "--group-size", "2", "--set", "max_tokens=6", "--set", "max_turns=1"]
METRIC_KEYS = {
    "step",
    "policy_version",
    "env_reward_mean",
    "loss",
    "grad_norm",
    "ratio_mean",
    "ratio_max_abs_log",
    "staleness_max",
    "rollouts_ok",
    "rollouts_failed",
    "groups_dropped_stale",
    "task_indices",
    "media_keys",
    "weight_sync_s",
    "step_s",
    "payload",
}


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]


def test_run_dir_holds_config_metrics_failures_and_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    argv = [*SMALL, "--steps", "3", "--set", "checkpoint_every=2", "--run-dir", str(run_dir), "--no-progress"]
    argv += ["--set", "replay_capacity_groups=2"]
    assert smoke.main(argv) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"run dir: {run_dir}"  # printed first
    saved = SmokeConfig.model_validate(yaml.safe_load((run_dir / "config.yaml").read_text()))
    assert saved.steps == 3 and saved.native and saved.checkpoint_every == 2 and saved.run_dir == str(run_dir)
    assert saved.warmup.steps == 40  # the resolved config: gymbridge/configs/smoke.yaml's values included
    recs = records(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert r.keys() >= METRIC_KEYS, METRIC_KEYS - r.keys()
        assert r["staleness_max"] == 0 and r["groups_dropped_stale"] == 0
        assert len(r["media_keys"]) == 1 and len(r["media_keys"][0]) == 64  # one image per prompt, sha256
        assert r["payload"]["rollout_to_policy"]["logical_media_bytes"] == (
            2 * r["payload"]["rollout_to_policy"]["physical_media_bytes"]
        )
    assert sorted(t for r in recs for t in r["task_indices"]) == [0, 1, 2]
    assert [r["policy_version"] for r in recs] == [1, 2, 3]
    assert (run_dir / "failures.jsonl").read_bytes() == b""  # written, empty: nothing failed
    latest = orjson.loads((run_dir / "checkpoints" / "latest.json").read_bytes())
    assert latest["step"] == 3  # every 2nd step and the last one
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "latest.json",
        "step-000002.ckpt",
        "step-000002.replay",
        "step-000003.ckpt",
        "step-000003.replay",
    ]
    assert (run_dir / "dataset.jsonl").is_file()
    # resuming a finished run changes nothing
    assert smoke.main(["--resume", str(run_dir), "--no-progress"]) == 0
    assert "nothing left to run" in capsys.readouterr().out
    assert [r["step"] for r in records(run_dir)] == [1, 2, 3]
    # the same directory again is refused (it holds a run): --resume it instead
    assert smoke.main([*argv]) == 2
    assert "--resume" in capsys.readouterr().err


def test_default_run_dir_is_under_runs_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert smoke.main([*SMALL, "--steps", "1", "--no-progress", "--set", "payload_metrics=false"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("run dir: runs/color_pick-")
    run_dir = tmp_path / first.removeprefix("run dir: ")
    assert sorted(os.listdir(run_dir)) == [
        "charts",
        "checkpoints",
        "config.yaml",
        "dataset.jsonl",
        "failures.jsonl",
        "media",
        "metrics.jsonl",
        "rollouts",
        "viewer",
    ]


def test_max_staleness_1_trains_one_version_behind_never_more(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--set rollout.max_staleness=1``: staleness 1 on the steps after the first, never above."""
    run_dir = tmp_path / "async"
    argv = [*SMALL, "--steps", "4", "--set", "rollout.max_staleness=1", "--run-dir", str(run_dir)]
    argv += ["--group-size", "6", "--set", "max_tokens=16", "--set", "trainer.lr=4e-2", "--no-progress"]
    assert smoke.main(argv) == 0
    out = capsys.readouterr().out
    recs = records(run_dir)
    staleness = [r["staleness_max"] for r in recs]
    assert staleness[:2] == [0, 1] and max(staleness) == 1, staleness
    assert all(r["groups_dropped_stale"] == 0 for r in recs)
    assert sorted(t for r in recs for t in r["task_indices"]) == [0, 1, 2, 3]
    assert "staleness 1 (dropped 0)" in out
    # a trajectory generated one version back, trained after an update: the ratio is no longer 1
    moved = [r for r in recs if r["staleness_max"] == 1 and abs(r["ratio_mean"] - 1.0) > 1e-4]
    assert moved, [(r["step"], r["ratio_mean"], r["grad_norm"]) for r in recs]
    assert all(r["weight_sync_s"] > 0 for r in recs if r["grad_norm"] > 0)


def test_resume_refuses_config_changes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert smoke.main(["--resume", str(tmp_path), "--steps", "9"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert smoke.main(["--resume", str(tmp_path / "nothing")]) == 2
    assert "config.yaml" in capsys.readouterr().err


def test_resumed_run_matches_an_uninterrupted_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that crashed in step 3 and was resumed from step 2's checkpoint prints what one
    uninterrupted run prints (native path, on-policy: sampling seeded per task and rollout;
    running ahead, which version samples a rollout depends on timing, so only the kill-and-resume
    invariants hold there, see test_resume_kill.py)."""
    import io

    from gymbridge.launch.smoke import build_config, resume_config, run_smoke
    from gymbridge.trainer import grpo

    flags = {"native": True, "steps": 4, "group_size": 4, "prompts_per_step": 1}
    sets = [("max_tokens", 12), ("max_turns", 1), ("payload_metrics", False), ("checkpoint_every", 1)]
    whole = run_smoke(build_config(None, sets, {**flags, "run_dir": str(tmp_path / "a")}), out=io.StringIO())

    real_step = grpo.GRPOTrainer.step
    calls = iter(range(100))

    def crash_in_step_3(self: grpo.GRPOTrainer, batch: Any) -> grpo.StepMetrics:
        if next(calls) == 2:
            raise RuntimeError("killed in step 3")
        return real_step(self, batch)

    monkeypatch.setattr(grpo.GRPOTrainer, "step", crash_in_step_3)
    with pytest.raises(RuntimeError, match="step 3"):
        run_smoke(build_config(None, sets, {**flags, "run_dir": str(tmp_path / "b")}), out=io.StringIO())
    monkeypatch.setattr(grpo.GRPOTrainer, "step", real_step)
    out = io.StringIO()
    resumed = run_smoke(resume_config(tmp_path / "b"), out=out, resume=True)
    assert resumed.resumed_from_step == 2 and "resumed: step 2/4, policy version 2" in out.getvalue()

    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return (r["step"], r["task_indices"], r["policy_version"], r["staleness_max"], r["num_loss_tokens"])

    a, b = records(tmp_path / "a"), records(tmp_path / "b")
    assert [key(r) for r in a] == [key(r) for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], abs=1e-6)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-5, abs=1e-7)
        assert rb["ratio_mean"] == pytest.approx(ra["ratio_mean"], abs=1e-6)
    assert [m.grad_norm for m in whole.steps][2:] == pytest.approx([m.grad_norm for m in resumed.steps])


def test_max_staleness_1_with_the_generator_in_its_own_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``generator.placement=process`` + ``rollout.max_staleness=1``: the child model server stamps
    the versions the bound is checked against; one version behind, never more, nothing dropped."""
    run_dir = tmp_path / "proc"
    argv = ["--no-progress", "--steps", "3", "--prompts", "1", "--group-size", "4", "--run-dir", str(run_dir)]
    argv += ["--set", "max_tokens=12", "--set", "max_turns=1", "--set", "payload_metrics=false"]
    argv += ["--set", "generator.placement=process", "--set", "rollout.max_staleness=1"]
    assert smoke.main(argv) == 0
    out = capsys.readouterr().out
    assert "generator: process" in out
    recs = records(run_dir)
    staleness = [r["staleness_max"] for r in recs]
    # batch 2 ran beside batch 1 (version 0); later batches are 1 behind unless training beat them
    assert staleness[:2] == [0, 1] and max(staleness) == 1, staleness
    assert [r["policy_version"] for r in recs] == [1, 2, 3]
    assert all(r["groups_dropped_stale"] == 0 for r in recs)
    assert sorted(t for r in recs for t in r["task_indices"]) == [0, 1, 2]
