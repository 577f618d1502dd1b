"""``dp.strategy: fsdp`` checkpoints are written by the workers and resume on any number of them.

The unit tests (no Ray) drive :func:`save_sharded_checkpoint` with a one-rank writer and
:func:`load_checkpoint` into a single-process trainer: the folder's layout, the weights, the
optimizer state (FQN-keyed, mapped onto a plain AdamW), the reference, the RNG, ``keep_last``,
old pointers, and the integrity errors. The run test drives tiny runs that crash in a step and
resume: on the same workers the losses are those of an uninterrupted run, and a folder saved by
2 workers resumes on 1, by 1 on 2, in one process, and a single-file checkpoint on 2 workers;
``gymbridge export`` reads the sharded checkpoint.
"""

from __future__ import annotations

import io
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
import yaml

from gymbridge.errors import CheckpointError
from gymbridge.trainer import GRPOTrainer, tiny_policy
from gymbridge.trainer.checkpoint import (
    LATEST,
    RUN_STATE,
    load_checkpoint,
    save_checkpoint,
    save_sharded_checkpoint,
)
from gymbridge.trainer.grpo import GRPOConfig
from gymbridge.trainer.sharded_checkpoint import (
    INDEX_NAME,
    flatten_model_and_optimizer,
    is_complete,
    read_meta,
    save_sharded,
)

CONFIG = GRPOConfig(kl_coef=0.05)


def trained(seed: int) -> GRPOTrainer:
    """A trainer whose AdamW stepped twice on random gradients (moments, step counts)."""
    torch.manual_seed(seed)
    trainer = GRPOTrainer(tiny_policy(seed), CONFIG)
    for _ in range(2):
        for p in trainer.model.parameters():
            p.grad = torch.randn_like(p)
        trainer.optimizer.step()
    trainer.steps = 2
    return trainer


def one_rank_writer(trainer: GRPOTrainer) -> Callable[[Path, dict[str, Any]], None]:
    """What an FSDP worker does, on one unsharded rank."""

    def write(folder: Path, meta: dict[str, Any]) -> None:
        tensors, index_meta = flatten_model_and_optimizer(trainer.model, trainer.optimizer)
        assert trainer.reference is not None
        tensors.update({f"reference.{k}": v for k, v in trainer.reference.state_dict().items()})
        save_sharded(folder, tensors, {**index_meta, **meta}, rank=0, world_size=1)

    return write


def save(root: Path, trainer: GRPOTrainer, step: int, keep: int = 2) -> Path:
    return save_sharded_checkpoint(
        root,
        step=step,
        policy_version=step + 10,
        trainer=trainer,
        done_task_indices=[3, 1],
        write_shards=one_rank_writer(trainer),
        keep=keep,
    )


def test_a_sharded_checkpoint_loads_into_one_process_with_its_optimizer_state(tmp_path: Path) -> None:
    source = trained(0)
    random.seed(7)
    folder = save(tmp_path, source, 2)
    expected_draw = random.random()
    assert folder == tmp_path / "step-000002" and is_complete(folder) and (folder / RUN_STATE).is_file()
    assert orjson.loads((tmp_path / LATEST).read_bytes()) == {
        "format": "gymbridge-run-checkpoint/1",
        "step": 2,
        "state": "step-000002",
        "kind": "sharded",
    }
    assert read_meta(folder)["run_step"] == 2

    target = GRPOTrainer(tiny_policy(1), CONFIG)
    state = load_checkpoint(tmp_path, trainer=target)
    assert state is not None and state.sharded and state.path == folder
    assert (state.step, state.policy_version, state.done_task_indices) == (2, 12, frozenset({1, 3}))
    assert target.steps == 2 and random.random() == expected_draw  # the RNG continues where it was
    assert target.reference is not None and source.reference is not None
    for got, want in ((target.model, source.model), (target.reference, source.reference)):
        for (name, a), (_, b) in zip(got.state_dict().items(), want.state_dict().items(), strict=True):
            assert torch.equal(a, b), name
    got_opt, want_opt = target.optimizer.state_dict(), source.optimizer.state_dict()
    assert got_opt["param_groups"] == want_opt["param_groups"]
    assert got_opt["state"].keys() == want_opt["state"].keys()
    for pid, entry in want_opt["state"].items():
        for key, value in entry.items():
            assert torch.equal(got_opt["state"][pid][key], value), (pid, key)


def test_optimizer_false_leaves_the_drivers_optimizer_blank(tmp_path: Path) -> None:
    save(tmp_path, trained(0), 2)
    target = GRPOTrainer(tiny_policy(1), CONFIG)
    assert load_checkpoint(tmp_path, trainer=target, optimizer=False) is not None
    assert not target.optimizer.state and target.steps == 2


def test_keep_last_removes_old_folders_and_files(tmp_path: Path) -> None:
    trainer = trained(0)
    save_checkpoint(tmp_path, step=1, policy_version=1, trainer=trainer, done_task_indices=[])
    assert orjson.loads((tmp_path / LATEST).read_bytes())["kind"] == "file"
    for step in (2, 3, 4):
        save(tmp_path, trainer, step)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step-000003", "step-000004"]


def test_a_pointer_without_a_kind_is_a_file(tmp_path: Path) -> None:
    trainer = trained(0)
    save_checkpoint(tmp_path, step=1, policy_version=1, trainer=trainer, done_task_indices=[])
    latest = orjson.loads((tmp_path / LATEST).read_bytes())
    del latest["kind"]
    (tmp_path / LATEST).write_bytes(orjson.dumps(latest))
    state = load_checkpoint(tmp_path, trainer=GRPOTrainer(tiny_policy(1), CONFIG))
    assert state is not None and not state.sharded and state.path.name == "step-000001.ckpt"


@pytest.mark.parametrize(
    "pointer",
    [
        {"step": 2, "state": "step-000002", "kind": "folder"},
        {"step": 2, "state": "../step-000002", "kind": "sharded"},
        {"step": 2, "state": "model", "kind": "sharded"},
    ],
    ids=["unknown-kind", "outside", "not-a-step"],
)
def test_a_pointer_that_is_not_one_is_refused(tmp_path: Path, pointer: dict[str, Any]) -> None:
    save(tmp_path, trained(0), 2)
    (tmp_path / LATEST).write_bytes(orjson.dumps({"format": "gymbridge-run-checkpoint/1", **pointer}))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path, trainer=GRPOTrainer(tiny_policy(1), CONFIG))
    assert Path(err.value.path).name == LATEST


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (lambda f: corrupt(f / RUN_STATE), RUN_STATE),
        (lambda f: (f / RUN_STATE).unlink(), RUN_STATE),
        (lambda f: corrupt(f / "rank-0-of-1.safetensors"), "rank-0-of-1.safetensors"),
        (lambda f: (f / "rank-0-of-1.safetensors").unlink(), "rank-0-of-1.safetensors"),
        (lambda f: corrupt(f / "rank-0-of-1.json"), "rank-0-of-1.json"),
        (lambda f: (f / INDEX_NAME).unlink(), INDEX_NAME),
    ],
    ids=["state-flipped", "state-missing", "data-flipped", "data-missing", "rank-index-flipped", "no-index"],
)
def test_a_damaged_sharded_checkpoint_raises_naming_the_file(
    tmp_path: Path, damage: Callable[[Path], None], named: str
) -> None:
    damage(save(tmp_path, trained(0), 2))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path, trainer=GRPOTrainer(tiny_policy(1), CONFIG))
    assert Path(err.value.path).name == named


def test_shards_of_another_step_are_refused(tmp_path: Path) -> None:
    trainer = trained(0)
    folder = save(tmp_path, trainer, 2)
    one_rank_writer(trainer)(folder, {"run_step": 5})  # e.g. a folder copied over from another step
    with pytest.raises(CheckpointError, match="holds step 5") as err:
        load_checkpoint(tmp_path, trainer=GRPOTrainer(tiny_policy(1), CONFIG))
    assert Path(err.value.path).name == INDEX_NAME


def test_a_sharded_checkpoint_without_a_reference_is_refused_when_kl_needs_one(tmp_path: Path) -> None:
    trainer = GRPOTrainer(tiny_policy(0), GRPOConfig())

    def write(folder: Path, meta: dict[str, Any]) -> None:
        tensors, index_meta = flatten_model_and_optimizer(trainer.model, trainer.optimizer)
        save_sharded(folder, tensors, {**index_meta, **meta}, rank=0, world_size=1)

    save_sharded_checkpoint(
        tmp_path, step=1, policy_version=1, trainer=trainer, done_task_indices=[], write_shards=write
    )
    with pytest.raises(CheckpointError, match="reference policy"):
        load_checkpoint(tmp_path, trainer=GRPOTrainer(tiny_policy(1), CONFIG))


# ---------------------------------------------------------------------------- runs (Ray)
SETTINGS: dict[str, Any] = {
    "rollout.native": True,
    "steps": 4,
    "bridge.group_size": 4,
    "bridge.prompts_per_step": 1,
    "rollout.max_tokens": 12,
    "warmup.steps": 0,
    "shaping.kind": "token_rate",
    "output.payload_metrics": False,
    "checkpoint.every": 1,
    "trainer.kl_coef": 0.05,
    "dp.strategy": "fsdp",
}


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]


def latest(run_dir: Path) -> dict[str, Any]:
    return dict(orjson.loads((run_dir / "checkpoints" / LATEST).read_bytes()))


def run(
    run_dir: Path,
    workers: int,
    monkeypatch: pytest.MonkeyPatch,
    *,
    crash_in_step: int | None = None,
    resume: bool = False,
) -> str:
    """Train ``run_dir`` on ``workers`` FSDP workers (0: one process); ``crash_in_step`` raises in
    that step's update (counted from the run's first step)."""
    from run_helpers import run_config

    from gymbridge.run import RunConfig, train
    from gymbridge.trainer import grpo, ray_dp

    if resume:
        saved = RunConfig.model_validate(yaml.safe_load((run_dir / "config.yaml").read_text()))
        output = saved.output.model_copy(update={"run_dir": str(run_dir)})  # a copied run: this one
        cfg = saved.model_copy(
            update={"dp": saved.dp.model_copy(update={"workers": workers}), "output": output}
        )
    else:
        cfg = run_config(run_dir, {**SETTINGS, "dp.workers": workers})
    out = io.StringIO()
    if crash_in_step is None:
        train(cfg, out=out, resume="must" if resume else "never")
        return out.getvalue()
    owner: Any = ray_dp.RayDPTrainer if workers else grpo.GRPOTrainer
    real = owner.step
    first = records(run_dir)[-1]["step"] + 1 if resume else 1
    calls = iter(range(first, 100))

    def crash(self: Any, batch: Any) -> Any:
        if next(calls) == crash_in_step:
            raise RuntimeError(f"killed in step {crash_in_step}")
        return real(self, batch)

    with monkeypatch.context() as patch:
        patch.setattr(owner, "step", crash)
        with pytest.raises(RuntimeError, match=f"killed in step {crash_in_step}"):
            train(cfg, out=out, resume="must" if resume else "never")
    return out.getvalue()


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in records(run_dir)]


def rows(run_dir: Path) -> list[list[int]]:
    return [r["task_indices"] for r in records(run_dir)]


@pytest.mark.integration
@pytest.mark.timeout(1500)
def test_fsdp_runs_resume_from_their_shards_on_any_number_of_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("ray")
    from gymbridge.cli import main

    whole = tmp_path / "whole"
    run(whole, 2, monkeypatch)
    assert [r["step"] for r in records(whole)] == [1, 2, 3, 4]
    expected = losses(whole)
    assert rows(whole) == [[0], [1], [2], [3]]
    assert latest(whole)["kind"] == "sharded"
    assert sorted(p.name for p in (whole / "checkpoints").iterdir()) == [LATEST, "step-000003", "step-000004"]
    assert sorted(p.name for p in (whole / "checkpoints" / "step-000004").iterdir()) == sorted(
        [INDEX_NAME, RUN_STATE, *(f"rank-{r}-of-2.{ext}" for r in (0, 1) for ext in ("json", "safetensors"))]
    )

    # killed in step 3 on 2 workers: step 2's folder, saved by 2 ranks
    crashed = tmp_path / "crashed"
    run(crashed, 2, monkeypatch, crash_in_step=3)
    assert latest(crashed) == {**latest(crashed), "step": 2, "kind": "sharded"}
    two_to_one, two_to_none = tmp_path / "two_to_one", tmp_path / "two_to_none"
    shutil.copytree(crashed, two_to_one)
    shutil.copytree(crashed, two_to_none)

    # 2 -> 2: the uninterrupted run's losses
    out = run(crashed, 2, monkeypatch, resume=True)
    assert "resumed: step 2/4" in out
    assert losses(crashed) == pytest.approx(expected, abs=1e-6)

    # gymbridge export reads the sharded run checkpoint (step 4, written by the workers)
    export = tmp_path / "export"
    assert main(["export", str(crashed), "--out", str(export)]) == 0
    import transformers

    exported = transformers.AutoModelForImageTextToText.from_pretrained(str(export), local_files_only=True)
    from gymbridge.trainer.sharded_checkpoint import iter_full_tensors

    final = dict(iter_full_tensors(crashed / "checkpoints" / "step-000004", prefix="model."))
    state = exported.state_dict()
    assert {f"model.{k}" for k in state} == set(final)
    for name, value in state.items():
        assert torch.equal(value, final[f"model.{name}"]), name

    # 2 -> 1 (killed in step 4: step 3's folder, saved by 1 rank), then 1 -> 2
    run(two_to_one, 1, monkeypatch, resume=True, crash_in_step=4)
    assert latest(two_to_one)["step"] == 3
    assert (two_to_one / "checkpoints" / "step-000003" / "rank-0-of-1.safetensors").is_file()
    run(two_to_one, 2, monkeypatch, resume=True)
    # the regression: a resumed run's checkpoint recorded only its own rows, so a second resume
    # trained row 0 again in step 4
    assert rows(two_to_one) == rows(whole)
    print("2->1->2 losses", losses(two_to_one), "uninterrupted", expected)
    assert losses(two_to_one) == pytest.approx(expected, abs=1e-5)

    # 2 -> one process (killed in step 4: a single-file checkpoint), then that file -> 2 workers
    run(two_to_none, 0, monkeypatch, resume=True, crash_in_step=4)
    assert latest(two_to_none) == {**latest(two_to_none), "step": 3, "kind": "file"}
    run(two_to_none, 2, monkeypatch, resume=True)
    assert rows(two_to_none) == rows(whole)
    print("2->0->2 losses", losses(two_to_none), "uninterrupted", expected)
    assert losses(two_to_none) == pytest.approx(expected, abs=1e-5)
