"""ReplayBuffer: whole groups in and out, media stored once, atomic and safe (safe_io) checkpoints."""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from bridge_helpers import FakeAgent, make_rows
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gymbridge.bridge import (
    BridgeConfig,
    BridgeIterator,
    GymRollouts,
    ReplayBuffer,
    ReplayCheckpointError,
    write_atomic,
)
from gymbridge.bridge.replay import CHECKPOINT_VERSION
from gymbridge.client import GymClient
from gymbridge.errors import CheckpointError
from gymbridge.metrics import PayloadMeter
from gymbridge.safe_io import encode_state, save_state
from gymbridge.tensors import MediaProcessor, TrainBatch
from gymbridge.testing.tiny_vlm import TinyVLM


@pytest.fixture
def batch(tiny: TinyVLM, processor: MediaProcessor) -> TrainBatch:
    agent = FakeAgent(tiny, lambda t, r: float(r % 2))
    client = GymClient("http://agent.test", transport=agent.transport())
    it = BridgeIterator(
        make_rows(3),
        GymRollouts(client),
        processor,
        BridgeConfig(group_size=4, prompts_per_step=3, min_group_size=None, max_consecutive_failed_groups=8),
    )
    return next(iter(it))


def test_sample_returns_whole_groups_renumbered(batch: TrainBatch) -> None:
    meter = PayloadMeter(enabled=True)
    buf = ReplayBuffer(10, seed=1, meter=meter)
    assert buf.push(batch) == 3
    out = buf.sample(2)
    assert len(out) == 8 and out.group_ids.tolist() == [0] * 4 + [1] * 4
    tasks = [m["task_index"] for m in out.metadata]
    assert tasks[:4] == [tasks[0]] * 4 and tasks[4:] == [tasks[4]] * 4 and tasks[0] != tasks[4]
    assert out.media["pixel_values"].num_segments == 2  # one image per sampled group, still shared
    assert set(meter.report()) == {"replay_push", "replay_sample"}
    with pytest.raises(ValueError, match="cannot sample 4"):
        buf.sample(4)


def test_checkpoint_roundtrip_keeps_media_deduplicated(batch: TrainBatch, tmp_path: Path) -> None:
    buf = ReplayBuffer(10)
    buf.push(batch)
    buf.push(batch)  # the same groups twice: their media must still be stored once
    path = tmp_path / "replay.ckpt"
    size = buf.save(path)
    unique = batch.media_physical_nbytes
    assert unique < size < unique * 1.3  # each image once in the file, not 8 times
    loaded = ReplayBuffer.load(path)
    assert len(loaded) == 6 and loaded.pushed_groups == 6
    whole = loaded.sample(6)
    assert whole.media["pixel_values"].num_segments == 3 and whole.media["pixel_values"].num_refs == 24
    for a, b in zip(buf.groups, loaded.groups, strict=True):
        torch.testing.assert_close(a.input_ids, b.input_ids)
        torch.testing.assert_close(
            a.media["pixel_values"].materialize(), b.media["pixel_values"].materialize()
        )
    assert [p.name for p in tmp_path.iterdir()] == ["replay.ckpt"]  # no temp file left behind


def test_a_crash_mid_write_leaves_the_previous_checkpoint_usable(batch: TrainBatch, tmp_path: Path) -> None:
    path = tmp_path / "replay.ckpt"
    buf = ReplayBuffer(10)
    buf.push(batch.select(torch.arange(4)))
    buf.save(path)
    before = path.read_bytes()

    def crashing_writer() -> Iterator[bytes]:
        data = encode_state(*ReplayBuffer(10).state())
        yield data[: len(data) // 2]
        raise KeyboardInterrupt("killed mid-write")

    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, crashing_writer())
    assert path.read_bytes() == before
    assert len(ReplayBuffer.load(path)) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["replay.ckpt"]


def test_a_truncated_checkpoint_is_a_clear_error(batch: TrainBatch, tmp_path: Path) -> None:
    path = tmp_path / "replay.ckpt"
    buf = ReplayBuffer(4)
    buf.push(batch)
    buf.save(path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ReplayCheckpointError, match=r"truncated|corrupt"):
        ReplayBuffer.load(path)
    with pytest.raises(ReplayCheckpointError, match="cannot read"):
        ReplayBuffer.load(tmp_path / "missing.ckpt")


def test_regression_sampling_keeps_rows_of_one_split_trajectory_together(batch: TrainBatch) -> None:
    """A trajectory split at a non-contiguous turn is several rows sharing one ``sample_id``;
    ``sample`` used to renumber ``sample_ids`` to ``arange``, so each row became its own sample
    (rewards counted twice in the step metrics, per-trajectory grouping lost)."""
    from dataclasses import replace

    # group 0: rows 0 and 1 are one split trajectory; groups 1 and 2 hold 4 trajectories each
    split = replace(batch, sample_ids=torch.tensor([0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]))
    buf = ReplayBuffer(10, seed=0)
    buf.push(split)
    out = buf.sample(3)
    sids = out.sample_ids.tolist()
    assert sids[0] == sids[1]  # still one trajectory
    assert len(set(sids)) == 11 and sorted(set(sids)) == list(range(11))  # dense, no collisions
    # across groups no two trajectories share an id
    assert not set(sids[:4]) & set(sids[4:8]) and not set(sids[4:8]) & set(sids[8:])


def test_regression_a_checkpoint_missing_fields_is_a_clear_error(tmp_path: Path) -> None:
    """A checkpoint without its fields crashed with a bare ``KeyError``."""
    path = tmp_path / "replay.ckpt"
    save_state(path, {}, {"version": CHECKPOINT_VERSION, "capacity_groups": 3})
    with pytest.raises(ReplayCheckpointError, match="missing or malformed"):
        ReplayBuffer.load(path)


def test_regression_inconsistent_group_sizes_are_a_clear_error(batch: TrainBatch, tmp_path: Path) -> None:
    buf = ReplayBuffer(4)
    buf.push(batch)
    tensors, meta = buf.state()
    meta["group_sizes"] = [4, 4, 4, 4]  # more rows than stored
    save_state(tmp_path / "r", tensors, meta)
    with pytest.raises(ReplayCheckpointError, match="group sizes"):
        ReplayBuffer.load(tmp_path / "r")


def test_regression_loading_a_replay_checkpoint_cannot_run_code(tmp_path: Path) -> None:
    """A replay checkpoint was a plain pickle: a crafted file ran ``os.system`` on load."""
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "replay.ckpt"
    path.write_bytes(pickle.dumps({"version": 1, "batch": Exploit()}))
    with pytest.raises(ReplayCheckpointError) as info:
        ReplayBuffer.load(path)
    assert not marker.exists()
    assert isinstance(info.value, CheckpointError) and info.value.path == str(path)


def test_regression_a_flipped_bit_in_a_replay_checkpoint_is_refused(
    batch: TrainBatch, tmp_path: Path
) -> None:
    """300 of 300 random bit flips of a pickled replay checkpoint loaded silently changed data."""
    buf = ReplayBuffer(4)
    buf.push(batch)
    path = tmp_path / "replay.ckpt"
    buf.save(path)
    good = path.read_bytes()
    bad = tmp_path / "flipped.ckpt"

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(bit=st.integers(min_value=0, max_value=len(good) * 8 - 1))
    def check(bit: int) -> None:
        raw = bytearray(good)
        raw[bit // 8] ^= 1 << (bit % 8)
        bad.write_bytes(bytes(raw))
        with pytest.raises(ReplayCheckpointError):
            ReplayBuffer.load(bad)

    check()
    assert len(ReplayBuffer.load(path)) == 3
