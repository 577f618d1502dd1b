"""Run checkpoints: a round trip restores weights, optimizer, RNGs and position; bad files are refused."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch
from safetensors import safe_open

from gymbridge.errors import CheckpointError
from gymbridge.trainer.checkpoint import latest_step, load_checkpoint, save_checkpoint
from gymbridge.trainer.grpo import GRPOConfig, GRPOTrainer


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 3)
        self.b = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def trained(seed: int = 0) -> GRPOTrainer:
    torch.manual_seed(seed)
    trainer = GRPOTrainer(Net(), GRPOConfig(lr=1e-2))
    for _ in range(3):  # real optimizer state: AdamW moments and step counts
        loss = trainer.model(torch.randn(5, 4)).pow(2).sum()
        grads = torch.autograd.grad(loss, trainer.params)
        trainer.apply_gradients(list(grads))
    return trainer


def test_round_trip_restores_weights_optimizer_rng_and_position(tmp_path: Path) -> None:
    src = trained()
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    save_checkpoint(tmp_path, step=3, policy_version=3, trainer=src, done_task_indices={0, 1, 2, 5})
    expect = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    dst = GRPOTrainer(Net(), GRPOConfig(lr=1e-2))
    state = load_checkpoint(tmp_path, trainer=dst)
    assert state is not None
    assert (state.step, state.policy_version, state.done_task_indices) == (3, 3, frozenset({0, 1, 2, 5}))
    assert dst.steps == src.steps == 3 and latest_step(tmp_path) == 3
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expect
    for p, q in zip(src.model.parameters(), dst.model.parameters(), strict=True):
        assert torch.equal(p, q)
    # the next update is identical: the optimizer's moments came back too
    x = torch.randn(5, 4)
    for t in (src, dst):
        t.apply_gradients(list(torch.autograd.grad(t.model(x).pow(2).sum(), t.params)))
    for p, q in zip(src.model.parameters(), dst.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_checkpoint_is_plain_safetensors_and_old_ones_are_pruned(tmp_path: Path) -> None:
    t = trained()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step=step, policy_version=step, trainer=t, done_task_indices=range(step))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest.json",
        "step-000002.ckpt",
        "step-000003.ckpt",
    ]
    with safe_open(str(tmp_path / "step-000003.ckpt"), framework="pt") as f:  # no pickle anywhere
        assert "model.a.weight" in set(f.keys())
    assert load_checkpoint(tmp_path / "empty", trainer=t) is None  # nothing saved yet: a fresh start


def test_tampered_or_truncated_checkpoint_is_refused_naming_the_file(tmp_path: Path) -> None:
    t = trained()
    ckpt = save_checkpoint(tmp_path, step=1, policy_version=1, trainer=t, done_task_indices=[0])
    raw = ckpt.read_bytes()
    ckpt.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path, trainer=t)
    assert err.value.path == str(ckpt)
    flipped = bytearray(raw)
    flipped[-10] ^= 0x01
    ckpt.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match=str(ckpt)):
        load_checkpoint(tmp_path, trainer=t)


@pytest.mark.parametrize(
    "latest",
    [b"{not json", b'{"format": "x", "step": 1, "state": "a"}', None],
    ids=["not_json", "foreign_format", "path_escape"],
)
def test_bad_latest_pointer_is_refused(tmp_path: Path, latest: bytes | None) -> None:
    t = trained()
    save_checkpoint(tmp_path, step=1, policy_version=1, trainer=t, done_task_indices=[0])
    pointer = tmp_path / "latest.json"
    if latest is None:
        data = orjson.loads(pointer.read_bytes())
        latest = orjson.dumps({**data, "state": "../../etc/passwd"})
    pointer.write_bytes(latest)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path, trainer=t)
    assert err.value.path == str(pointer)


def test_weights_of_another_model_are_refused(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, step=1, policy_version=1, trainer=trained(), done_task_indices=[0])
    other = GRPOTrainer(torch.nn.Linear(4, 2), GRPOConfig())
    with pytest.raises(CheckpointError, match="weights do not fit"):
        load_checkpoint(tmp_path, trainer=other)


def test_done_rows_are_stored_as_ranges_not_one_entry_per_row(tmp_path: Path) -> None:
    """A run of 200,000 rows done in order checkpoints one range: the JSON does not grow with the run."""
    from gymbridge.safe_io import load_state

    ckpt = save_checkpoint(
        tmp_path, step=1, policy_version=1, trainer=trained(), done_task_indices=range(200_000)
    )
    _, meta = load_state(ckpt)
    assert meta["done_rows"] == [[0, 200_000]] and "done_task_indices" not in meta
    state = load_checkpoint(tmp_path, trainer=GRPOTrainer(Net(), GRPOConfig(lr=1e-2)))
    assert state is not None and len(state.done_task_indices) == 200_000
    assert 199_999 in state.done_task_indices and 200_000 not in state.done_task_indices


@pytest.mark.parametrize(
    ("rows", "expect"),
    [({"done_task_indices": [5, 0, 1, 2]}, {0, 1, 2, 5}), ({"done_rows": [[0, 3], [5, 6]]}, {0, 1, 2, 5})],
)
def test_a_checkpoint_listing_every_row_still_loads(tmp_path: Path, rows: dict, expect: set[int]) -> None:
    """Checkpoints written before the ranges list each done row (``done_task_indices``)."""
    from gymbridge.safe_io import load_state, save_state

    ckpt = save_checkpoint(tmp_path, step=1, policy_version=1, trainer=trained(), done_task_indices=[])
    tensors, meta = load_state(ckpt)
    meta.pop("done_rows")
    save_state(ckpt, tensors, {**meta, **rows})
    state = load_checkpoint(tmp_path, trainer=GRPOTrainer(Net(), GRPOConfig(lr=1e-2)))
    assert state is not None and state.done_task_indices == expect


@pytest.mark.parametrize("bad", [[[3, 1]], [[0, "9"]], "all", [[-2, 1]]])
def test_malformed_done_rows_are_a_checkpoint_error(tmp_path: Path, bad: object) -> None:
    from gymbridge.safe_io import load_state, save_state

    ckpt = save_checkpoint(tmp_path, step=1, policy_version=1, trainer=trained(), done_task_indices=[0])
    tensors, meta = load_state(ckpt)
    save_state(ckpt, tensors, {**meta, "done_rows": bad})
    with pytest.raises(CheckpointError, match="malformed run state"):
        load_checkpoint(tmp_path, trainer=GRPOTrainer(Net(), GRPOConfig(lr=1e-2)))
