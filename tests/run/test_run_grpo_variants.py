"""The GRPO variants from the run: ``gymbridge smoke run --set trainer.kl_coef=...`` and friends."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest
import torch

from gymbridge.cli import main as cli_main
from gymbridge.errors import ConfigError
from gymbridge.run import load_run_config
from gymbridge.run.data import write_dataset
from gymbridge.tensors.batch import group_advantages

pytestmark = pytest.mark.integration


def main(argv: list[str]) -> int:
    return cli_main(["smoke", "run", *argv])


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_every_variant_runs_from_the_launcher_and_lands_in_metrics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    argv = ["--native", "--steps", "3", "--prompts", "2", "--group-size", "4", "--no-progress"]
    argv += ["--run-dir", str(run)]
    for kv in (
        "trainer.kl_coef=0.05",
        "trainer.kl_estimator=k3",
        "trainer.top_p=0.9",
        "trainer.loss_agg=seq_mean_token_mean",
        "trainer.mask_truncated=true",
        "bridge.dynamic_sampling=true",
        "bridge.dynamic_sampling_max_rounds=1",
    ):
        argv += ["--set", kv]
    assert main(argv) == 0
    out = capsys.readouterr().out
    records = _lines(run / "metrics.jsonl")
    assert len(records) == 3
    assert "kl " in out and "(k3)" in out and "truncated masked" in out and "zero-variance dropped" in out
    # the generator sampled at top_p 0.9 (every row says so) and the trainer's nucleus matches it
    rows = _lines(run / "dataset.jsonl")
    assert len(rows) == 3 * 2 * 2 and all(r["responses_create_params"]["top_p"] == 0.9 for r in rows)
    trained = [r for r in records if r["skipped"] is None]
    assert trained and all(abs(float(r["ratio_mean"]) - 1.0) < 1e-4 for r in trained)  # type: ignore[arg-type]
    # KL to the frozen (post-warm-up) reference: 0 at the first update, > 0 once the policy moved
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-7)
    assert any(float(r["kl"]) > 0 for r in records[1:])  # type: ignore[arg-type]
    assert all(isinstance(r["truncated_masked"], int) for r in records)
    # every group dynamic sampling left out is in failures.jsonl, with the step that dropped it
    dropped = [f for f in _lines(run / "failures.jsonl") if f["failure_class"] == "zero_variance"]
    assert sum(int(r["groups_zero_variance_dropped"]) for r in records) == len(dropped)  # type: ignore[call-overload]
    assert sorted(i for r in records for i in r["zero_variance_task_indices"]) == sorted(  # type: ignore[attr-defined]
        int(f["task_index"])
        for f in dropped  # type: ignore[call-overload]
    )


def test_mask_truncated_from_the_launcher_masks_rollouts_cut_at_max_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One generated token cannot hold an answer and its end token: every rollout is cut, none trains."""
    run = tmp_path / "run"
    argv = ["--native", "--steps", "1", "--prompts", "1", "--group-size", "2", "--no-progress"]
    argv += ["--run-dir", str(run), "--set", "rollout.max_tokens=1", "--set", "trainer.mask_truncated=true"]
    assert main(argv) == 0
    (record,) = _lines(run / "metrics.jsonl")
    assert record["truncated_masked"] == 2 and record["num_loss_tokens"] == 0
    assert record["skipped"] == "no_loss_tokens" and record["policy_version"] == 0
    assert "truncated masked 2" in capsys.readouterr().out


@pytest.mark.parametrize("setting", ["top_p", "temperature"])
def test_a_dataset_row_asking_for_other_sampling_is_a_config_error(tmp_path: Path, setting: str) -> None:
    """Regression (temperature): only top_p was checked; a row's own temperature biased the ratio."""

    class RowsAsking:
        def check_params(self, params: dict[str, object]) -> None:
            pass

        def generate(self, n: int, seed: int, **params: object) -> list[dict[str, object]]:
            return [{"responses_create_params": {"input": "hi", setting: 0.5}} for _ in range(n)]

    cfg = load_run_config(["smoke"], [(f"trainer.{setting}", 0.9), ("steps", 1)])
    with pytest.raises(
        ConfigError, match=rf"row 0 asks for {setting}=0.5 but the trainer scores with {setting}=0.9"
    ):
        write_dataset(cfg, RowsAsking(), tmp_path / "dataset.jsonl")
    with pytest.raises(ConfigError, match=r"trainer\.top_p"):
        load_run_config(["smoke"], [("trainer.top_p", 0.0)])


def test_regression_a_user_dataset_gets_the_same_sampling_rule(tmp_path: Path) -> None:
    """``gymbridge train --dataset`` rows went through their own copy of the defaults, without the
    top_p fill-in and check the generated rows get."""
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(orjson.dumps({"responses_create_params": {"input": "hi"}}) + b"\n")
    cfg = load_run_config(["smoke"], [("trainer.top_p", 0.9), ("steps", 1)], {"dataset": str(rows)})
    out = tmp_path / "dataset.jsonl"
    assert write_dataset(cfg, None, out)[0] == 1
    written = orjson.loads(out.read_bytes())["responses_create_params"]
    assert written["top_p"] == 0.9 and written["temperature"] == 1.0
    with rows.open("ab") as f:
        f.write(orjson.dumps({"responses_create_params": {"input": "hi", "top_p": 0.5}}) + b"\n")
    with pytest.raises(ConfigError, match=r"line 2 asks for top_p=0.5 but the trainer scores with top_p=0.9"):
        write_dataset(cfg, None, out)


@pytest.mark.parametrize("mode", ["group_mean", "group_norm", "batch_norm", "batch_mean"])
def test_advantage_mode_from_the_launcher_reaches_every_rollout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    """``--set bridge.advantage=group_mean`` (Dr. GRPO: no std division) reaches the trained rollouts;
    a batch mode's baseline is the step's rollouts, and its records show what was trained."""
    run = tmp_path / "run"
    argv = ["--native", "--steps", "2", "--prompts", "2", "--group-size", "4", "--no-progress"]
    argv += ["--run-dir", str(run), "--set", f"bridge.advantage={mode}"]
    assert main(argv) == 0
    capsys.readouterr()
    checked = mixed = 0
    for step in (1, 2):
        rollouts = _lines(run / "rollouts" / f"step_{step}.jsonl")
        groups: dict[object, list[dict[str, object]]] = {}
        for r in rollouts:
            groups.setdefault(r["group"], []).append(r)
        for group in groups.values():
            rewards = torch.tensor([float(r["reward"]) for r in group])  # type: ignore[arg-type]
            mixed += bool(rewards.std() > 0)
            want = group_advantages(rewards, len(group), mode=mode)  # type: ignore[arg-type]
            if mode.startswith("batch"):
                every = torch.tensor([float(r["reward"]) for r in rollouts])  # type: ignore[arg-type]
                whole = group_advantages(every, len(every), mode=mode).tolist()  # type: ignore[arg-type]
                want = torch.tensor([whole[rollouts.index(r)] for r in group])
            for r, a in zip(group, want.tolist(), strict=True):
                assert float(r["advantage"]) == pytest.approx(a, abs=1e-5)  # type: ignore[arg-type]
                checked += 1
    assert checked == 2 * 2 * 4 and mixed  # a group with reward variance tells the modes apart
    with pytest.raises(ConfigError, match="advantage"):
        load_run_config(["smoke"], [("bridge.advantage", "z_score")])
