"""The run directory and resume: config, metrics, failures, checkpoints; continue, refuse, or start afresh."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from gymbridge.cli import main as cli_main
from gymbridge.run import RunConfig, RunDir

pytestmark = pytest.mark.integration

# toy shaping on the random model's 16 tokens: groups have reward variance, so steps train
SMALL = ["--native", "--prompts", "1", "--group-size", "2", "--set", "rollout.max_tokens=16"]
SMALL += ["--set", "warmup.steps=0", "--set", "shaping.kind=token_rate"]
METRIC_KEYS = {
    "step",
    "policy_version",
    "published",
    "skipped",
    "env_reward_mean",
    "loss",
    "grad_norm",
    "ratio_mean",
    "ratio_max_abs_log",
    "staleness_max",
    "rollouts_ok",
    "rollouts_failed",
    "groups_dropped_stale",
    "groups_zero_variance",
    "task_indices",
    "media_keys",
    "weight_sync_s",
    "step_s",
    "payload",
    "timing/wait_rollouts",
    "timing/forward_backward",
    "timing/other",
}


def main(argv: list[str]) -> int:
    return cli_main(["smoke", "run", *argv])


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]


def test_run_dir_holds_config_metrics_failures_and_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    argv = [*SMALL, "--steps", "3", "--set", "checkpoint.every=2", "--run-dir", str(run_dir), "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"run dir: {run_dir}"  # printed first
    saved = RunConfig.model_validate(yaml.safe_load((run_dir / "config.yaml").read_text()))
    assert saved.steps == 3 and saved.rollout.native and saved.checkpoint.every == 2
    assert saved.output.run_dir == str(run_dir) and saved.trainer.lr == 2e-3  # resolved: the overlay's values
    recs = records(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert r.keys() >= METRIC_KEYS, METRIC_KEYS - r.keys()
        assert r["staleness_max"] == 0 and r["groups_dropped_stale"] == 0
        assert len(r["media_keys"]) == 1 and len(r["media_keys"][0]) == 64  # one image per prompt, sha256
        assert r["payload"]["rollout_to_policy"]["logical_media_bytes"] == (
            2 * r["payload"]["rollout_to_policy"]["physical_media_bytes"]
        )
        assert all(v >= 0 for k, v in r.items() if k.startswith("timing/"))  # ``other`` too: no overlap
        assert r["timing/weight_sync"] >= r["weight_sync_s"]  # the publication, measured around it
    assert sorted(t for r in recs for t in r["task_indices"]) == [0, 1, 2]
    trained = [r["policy_version"] for r in recs if r["skipped"] is None]
    assert trained == list(range(1, len(trained) + 1)) and recs[-1]["policy_version"] == len(trained)
    assert (run_dir / "failures.jsonl").read_bytes() == b""  # written, empty: nothing failed
    latest = orjson.loads((run_dir / "checkpoints" / "latest.json").read_bytes())
    assert latest["step"] == 3  # every 2nd step and the last one
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "latest.json",
        "step-000002.ckpt",
        "step-000003.ckpt",
    ]
    # resuming a finished run starts nothing and changes nothing
    assert main(["--resume", str(run_dir), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "nothing left to run: the checkpoint holds all 3 step(s)" in out and "servers:" not in out
    assert [r["step"] for r in records(run_dir)] == [1, 2, 3]
    # the same directory again is refused (it holds a run): --resume it instead
    assert main([*argv]) == 2
    assert "--resume" in capsys.readouterr().err


def test_a_default_run_always_leaves_a_final_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``checkpoint.every`` is on by default (50) and the last step always gets one; the default run
    directory is under ``runs/`` and kept."""
    monkeypatch.chdir(tmp_path)
    assert main([*SMALL, "--steps", "1", "--no-progress", "--set", "output.payload_metrics=false"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("run dir: runs/color_pick-")
    run_dir = tmp_path / first.removeprefix("run dir: ")
    assert sorted(os.listdir(run_dir)) == [
        "charts",
        "checkpoints",
        "config.yaml",
        "dataset.jsonl",
        "export",
        "failures.jsonl",
        "media",
        "metrics.jsonl",
        "rollouts",
        "viewer",
    ]
    assert orjson.loads((run_dir / "checkpoints" / "latest.json").read_bytes())["step"] == 1


def test_resume_of_a_run_without_a_checkpoint_refuses_and_keeps_its_history(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: ``--resume`` of a run killed before its first checkpoint wiped metrics.jsonl and
    failures.jsonl, skipped the format warm-up and the KL reference, and retrained from random
    weights, saying only "resumed: no checkpoint yet"."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = RunConfig.model_validate({"env": {"name": "color_pick"}, "output": {"run_dir": str(run_dir)}})
    RunDir.create(run_dir).write_config(cfg.model_dump(mode="json"))
    history = b'{"step":1,"loss":0.5}\n'
    failures = b'{"kind":"rollout","task_index":0,"failure_class":"HTTPError"}\n'
    (run_dir / "metrics.jsonl").write_bytes(history)
    (run_dir / "failures.jsonl").write_bytes(failures)
    assert main(["--resume", str(run_dir), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint in" in err and f"--resume-or-start {run_dir}" in err
    assert (run_dir / "metrics.jsonl").read_bytes() == history  # untouched
    assert (run_dir / "failures.jsonl").read_bytes() == failures
    # --resume-or-start: a fresh start in the same directory, the earlier lines kept aside
    overrides = {"steps": 1, "bridge": {"prompts_per_step": 1, "group_size": 2}, "warmup": {"steps": 3}}
    small = RunConfig.model_validate({**cfg.model_dump(mode="json"), **overrides})
    small = small.model_copy(update={"trainer": small.trainer.model_copy(update={"lr_decay_steps": 1})})
    RunDir(run_dir).write_config(small.model_dump(mode="json"))
    assert cli_main(["train", "--resume-or-start", str(run_dir), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "starting afresh (2 earlier lines in *.rewound.jsonl)" in out
    assert "format warm-up: 3 supervised steps" in out  # a fresh start runs its warm-up
    assert (run_dir / "metrics.rewound.jsonl").read_bytes() == history
    assert (run_dir / "failures.rewound.jsonl").read_bytes() == failures
    assert [r["step"] for r in records(run_dir)] == [1]


def test_rewind_moves_lines_after_the_checkpoint_never_drops_them(tmp_path: Path) -> None:
    run = RunDir.create(tmp_path)
    lines = [b'{"step":1}', b'{"step":2}', b'{"step":3}', b'{"step":4,"torn']
    run.metrics_path.write_bytes(b"\n".join(lines) + b"\n")
    run.failures_path.write_bytes(b'{"task_index":0}\n{"task_index":5}\n')
    assert run.rewind(last_step=2, done_task_indices=[0]) == 3
    assert [r["step"] for r in run.metrics()] == [1, 2]
    aside = run.path / "metrics.rewound.jsonl"
    assert aside.read_bytes().splitlines() == lines[2:]
    assert [r["task_index"] for r in run.failures()] == [0]
    assert (run.path / "failures.rewound.jsonl").read_bytes() == b'{"task_index":5}\n'


def test_max_staleness_1_trains_one_version_behind_never_more(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--set bridge.max_staleness=1``: staleness 1 on the steps after the first, never above."""
    run_dir = tmp_path / "async"
    argv = [*SMALL, "--steps", "4", "--set", "bridge.max_staleness=1", "--run-dir", str(run_dir)]
    argv += ["--group-size", "6", "--set", "trainer.lr=4e-2", "--no-progress"]
    assert main(argv) == 0
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
    assert all(r["weight_sync_s"] > 0 for r in recs if r["skipped"] is None)


def test_resume_refuses_config_changes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--resume", str(tmp_path), "--steps", "9"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert main(["--resume", str(tmp_path / "nothing")]) == 2
    assert "config.yaml" in capsys.readouterr().err


def test_resumed_run_matches_an_uninterrupted_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that crashed in step 3 and was resumed from step 2's checkpoint prints what one
    uninterrupted run prints (native path, on-policy: sampling seeded per task and rollout;
    running ahead, which version samples a rollout depends on timing, so only the kill-and-resume
    invariants hold there, see test_resume_kill.py)."""
    import io

    from run_helpers import run_config

    from gymbridge.run import train
    from gymbridge.trainer import grpo

    settings = {
        "rollout.native": True,
        "steps": 4,
        "bridge.group_size": 4,
        "bridge.prompts_per_step": 1,
        "rollout.max_tokens": 12,
        "warmup.steps": 0,
        "shaping.kind": "token_rate",
        "output.payload_metrics": False,
        "checkpoint.every": 1,
    }
    whole = train(run_config(tmp_path / "a", settings), out=io.StringIO())

    real_step = grpo.GRPOTrainer.step
    calls = iter(range(100))

    def crash_in_step_3(self: grpo.GRPOTrainer, batch: Any) -> grpo.StepMetrics:
        if next(calls) == 2:
            raise RuntimeError("killed in step 3")
        return real_step(self, batch)

    monkeypatch.setattr(grpo.GRPOTrainer, "step", crash_in_step_3)
    with pytest.raises(RuntimeError, match="step 3"):
        train(run_config(tmp_path / "b", settings), out=io.StringIO())
    monkeypatch.setattr(grpo.GRPOTrainer, "step", real_step)
    out = io.StringIO()
    cfg = RunConfig.model_validate(yaml.safe_load((tmp_path / "b" / "config.yaml").read_text()))
    resumed = train(cfg, out=out, resume="must")
    version = records(tmp_path / "a")[1]["policy_version"]
    assert resumed.resumed_from_step == 2 and f"resumed: step 2/4, policy version {version}" in out.getvalue()

    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return (r["step"], r["task_indices"], r["policy_version"], r["staleness_max"], r["num_loss_tokens"])

    a, b = records(tmp_path / "a"), records(tmp_path / "b")
    assert [key(r) for r in a] == [key(r) for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], abs=1e-6)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-5, abs=1e-7)
        assert rb["ratio_mean"] == pytest.approx(ra["ratio_mean"], abs=1e-6)
    assert [m.grad_norm for m in whole.steps][2:] == pytest.approx([m.grad_norm for m in resumed.steps])


def test_regression_a_second_resume_trains_no_row_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resumed run's checkpoints recorded only the rows it trained itself, so resuming it again
    trained the first attempt's rows a second time."""
    import io

    from run_helpers import run_config

    from gymbridge.run import train
    from gymbridge.trainer import grpo

    settings = {
        "rollout.native": True,
        "steps": 4,
        "bridge.group_size": 2,
        "bridge.prompts_per_step": 1,
        "rollout.max_tokens": 8,
        "warmup.steps": 0,
        "shaping.kind": "token_rate",
        "output.payload_metrics": False,
        "output.artifacts": False,
        "output.export": "none",
        "checkpoint.every": 1,
    }
    train(run_config(tmp_path / "a", settings), out=io.StringIO())
    real_step = grpo.GRPOTrainer.step

    def crash_at(update: int) -> None:
        calls = iter(range(100))

        def step(self: grpo.GRPOTrainer, batch: Any) -> grpo.StepMetrics:
            if next(calls) == update:
                raise RuntimeError("killed")
            return real_step(self, batch)

        monkeypatch.setattr(grpo.GRPOTrainer, "step", step)

    crash_at(2)  # killed in step 3: checkpoints of steps 1-2
    with pytest.raises(RuntimeError, match="killed"):
        train(run_config(tmp_path / "b", settings), out=io.StringIO())
    cfg = RunConfig.model_validate(yaml.safe_load((tmp_path / "b" / "config.yaml").read_text()))
    crash_at(1)  # resumed at step 3, killed in step 4: step 3's checkpoint is the resumed run's
    with pytest.raises(RuntimeError, match="killed"):
        train(cfg, out=io.StringIO(), resume="must")
    monkeypatch.setattr(grpo.GRPOTrainer, "step", real_step)
    train(cfg, out=io.StringIO(), resume="must")
    assert [r["task_indices"] for r in records(tmp_path / "b")] == [
        r["task_indices"] for r in records(tmp_path / "a")
    ]


def test_max_staleness_1_with_the_generator_in_its_own_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``generator.placement=process`` + ``bridge.max_staleness=1``: the child model server stamps
    the versions the bound is checked against; one version behind, never more, nothing dropped."""
    run_dir = tmp_path / "proc"
    argv = ["--no-progress", "--steps", "3", "--prompts", "1", "--group-size", "4", "--run-dir", str(run_dir)]
    argv += [
        "--set",
        "rollout.max_tokens=12",
        "--set",
        "output.payload_metrics=false",
        "--set",
        "warmup.steps=0",
    ]
    argv += ["--set", "shaping.kind=token_rate"]
    argv += ["--set", "generator.placement=process", "--set", "bridge.max_staleness=1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "generator: process" in out
    recs = records(run_dir)
    staleness = [r["staleness_max"] for r in recs]
    # batch 2 ran beside batch 1 (version 0); later batches are 1 behind unless training beat them
    assert staleness[:2] == [0, 1] and max(staleness) == 1, staleness
    assert all(r["groups_dropped_stale"] == 0 for r in recs)
    assert sorted(t for r in recs for t in r["task_indices"]) == [0, 1, 2]


@pytest.mark.parametrize("last_step", [0, 1, 1500, 2999, 3000, 3001])
def test_rewind_of_a_long_metrics_file_cuts_its_tail_in_place(tmp_path: Path, last_step: int) -> None:
    """A resume of a 3,000-step run moves the lines after its checkpoint (and a torn last line)
    and leaves the file's kept bytes where they are: the same file, cut, not a rewrite."""
    run = RunDir.create(tmp_path)
    pad = "x" * 90  # ~100 bytes a line: the file spans several of the backward reader's blocks
    lines = [orjson.dumps({"step": s, "pad": pad}) for s in range(1, 3001)] + [b'{"step":3001,"to']
    run.metrics_path.write_bytes(b"\n".join(lines) + b"\n")
    inode = run.metrics_path.stat().st_ino
    kept = min(last_step, 3000)
    assert run.rewind(last_step=last_step, done_task_indices=[]) == len(lines) - kept
    assert run.metrics_path.stat().st_ino == inode
    assert run.metrics_path.read_bytes() == b"".join(line + b"\n" for line in lines[:kept])
    assert (run.path / "metrics.rewound.jsonl").read_bytes().splitlines() == lines[kept:]
    assert run.has_metrics() == (kept > 0)
