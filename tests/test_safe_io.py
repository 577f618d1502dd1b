"""safe_io: state files that round-trip, refuse every corruption, and never run code."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gymbridge.errors import CheckpointError
from gymbridge.safe_io import (
    MAX_META_DEPTH,
    decode_state,
    encode_state,
    load_state,
    remove_stale_temps,
    save_state,
    verify_state,
    write_atomic,
)

TENSORS = {
    "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "ids": torch.tensor([1, 2, 3], dtype=torch.int64),
    "bf": torch.tensor([0.5, -2.0], dtype=torch.bfloat16),
    "mask": torch.tensor([True, False]),
    "empty": torch.zeros(0, 5),
}
META = {"step": 7, "rng": [3, [1, 2, 3], None], "name": 'x"y', "nested": {"a": [1.5, {"b": None}]}}
STATE = encode_state(TENSORS, META)


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k], v), k


def test_roundtrip_keeps_dtypes_shapes_values_and_meta(tmp_path: Path) -> None:
    path = tmp_path / "state.safetensors"
    size = save_state(path, TENSORS, META)
    assert size == path.stat().st_size
    tensors, meta = load_state(path)
    _assert_same(tensors, TENSORS)
    assert meta == META


def test_the_file_is_a_standard_safetensors_file(tmp_path: Path) -> None:
    from safetensors import safe_open

    path = tmp_path / "state.safetensors"
    save_state(path, TENSORS, META)
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(TENSORS)
        assert f.metadata()["gymbridge.format"] == "gymbridge-state/1"


def test_views_of_one_storage_and_non_contiguous_tensors_are_saved(tmp_path: Path) -> None:
    base = torch.arange(20.0).reshape(4, 5)
    tensors = {"a": base, "row": base[1], "t": base.t()}
    save_state(tmp_path / "s", tensors, {})
    got, _ = load_state(tmp_path / "s")
    _assert_same(got, {k: v.contiguous() for k, v in tensors.items()})


def test_regression_a_crafted_pickle_cannot_run_code(tmp_path: Path) -> None:
    """Replay checkpoints were plain pickles: a crafted file ran ``os.system`` on load."""
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "evil.ckpt"
    path.write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(CheckpointError) as info:
        load_state(path)
    assert not marker.exists()
    assert info.value.path == str(path) and str(path) in str(info.value)


def test_regression_a_torch_save_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2)}, path)
    with pytest.raises(CheckpointError, match=r"not a gymbridge state file|header length"):
        load_state(path)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bit=st.integers(min_value=0, max_value=len(STATE) * 8 - 1))
def test_regression_every_flipped_bit_is_refused(bit: int) -> None:
    """300 of 300 random bit flips of a pickled checkpoint loaded silently changed data."""
    raw = bytearray(STATE)
    raw[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CheckpointError):
        decode_state(bytes(raw), path="flipped")


def test_verify_state_streams_the_checks_load_state_makes(tmp_path: Path) -> None:
    """The streamed check returns the meta of a sound file and refuses what load_state refuses."""
    path = tmp_path / "s.state"
    path.write_bytes(STATE)
    assert verify_state(path, chunk_bytes=7) == META
    for bit in range(0, len(STATE) * 8, 97):
        raw = bytearray(STATE)
        raw[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(bytes(raw))
        with pytest.raises(CheckpointError):
            verify_state(path, chunk_bytes=7)
    for cut in range(0, len(STATE), 41):
        path.write_bytes(STATE[:cut])
        with pytest.raises(CheckpointError):
            verify_state(path)


@settings(max_examples=200, deadline=None)
@given(cut=st.integers(min_value=0, max_value=len(STATE) - 1))
def test_every_truncation_is_refused(cut: int) -> None:
    with pytest.raises(CheckpointError):
        decode_state(STATE[:cut], path="cut")


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=512))
def test_arbitrary_bytes_are_a_checkpoint_error_and_nothing_else(data: bytes) -> None:
    """An ``OverflowError`` (and other builtins) escaped the typed error for crafted files."""
    with pytest.raises(CheckpointError):
        decode_state(data, path="junk")


def test_regression_huge_header_length_is_refused_without_overflow() -> None:
    raw = (2**64 - 1).to_bytes(8, "little") + b"{}"
    with pytest.raises(CheckpointError, match="header length"):
        decode_state(raw)


def test_missing_file_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="cannot read") as info:
        load_state(tmp_path / "nope")
    assert info.value.path.endswith("nope")


def test_meta_deeper_than_the_limit_is_refused_on_save() -> None:
    deep: object = 1
    for _ in range(MAX_META_DEPTH + 1):
        deep = [deep]
    with pytest.raises(ValueError, match="deeper"):
        encode_state({}, {"x": deep})


def test_non_json_meta_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        encode_state({}, {"x": object()})


def test_regression_stale_temp_of_a_killed_save_is_removed_at_next_save_and_load(tmp_path: Path) -> None:
    """A save killed mid-write left its temp file behind forever (213 MiB in one run)."""
    path = tmp_path / "state.ckpt"
    code = (
        "import os, sys\n"
        "from gymbridge.safe_io import write_atomic\n"
        "def chunks():\n"
        "    yield b'x' * 100000\n"
        "    os._exit(9)  # killed mid-write: no cleanup runs\n"
        f"write_atomic({str(path)!r}, chunks())\n"
    )
    subprocess.run([sys.executable, "-c", code], check=False)
    stale = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(stale) == 1 and stale[0].stat().st_size == 100000
    save_state(path, TENSORS, META)
    assert [p.name for p in tmp_path.iterdir()] == ["state.ckpt"]

    subprocess.run([sys.executable, "-c", code], check=False)
    assert len(list(tmp_path.iterdir())) == 2
    load_state(path)
    assert [p.name for p in tmp_path.iterdir()] == ["state.ckpt"]


def test_temp_of_a_live_writer_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    live = tmp_path / f".ckpt.{os.getppid()}.abcdefgh.tmp"  # parent process: alive
    live.write_bytes(b"in progress")
    other = tmp_path / ".other.1.abcdefgh.tmp"  # another target's temp: not ours to remove
    other.write_bytes(b"x")
    assert remove_stale_temps(path) == 0
    assert live.exists() and other.exists()


def test_write_atomic_keeps_the_old_file_when_the_writer_fails(tmp_path: Path) -> None:
    path = tmp_path / "f"
    write_atomic(path, [b"old"])

    def broken() -> object:
        yield b"new"
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        write_atomic(path, broken())  # type: ignore[arg-type]
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["f"]


def test_writes_into_a_folder_list_it_once_and_the_first_removes_dead_writers_temps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run writes one file a step into ``rollouts/``: listing that folder at every write made each
    write cost the folder's size (24 ms at 10,000 files). The first write of a process sweeps the
    folder; later writes do not list it."""
    folder = tmp_path / "rollouts"
    folder.mkdir()
    dead = folder / ".step_1.jsonl.999999999.abcdefgh.tmp"  # no such pid: its writer is gone
    dead.write_bytes(b"x" * 10)
    live = folder / f".step_2.jsonl.{os.getppid()}.abcdefgh.tmp"  # a live writer's: kept
    live.write_bytes(b"y")
    listed: list[Path] = []
    real = Path.iterdir

    def counting(self: Path) -> object:
        listed.append(self)
        return real(self)

    monkeypatch.setattr(Path, "iterdir", counting)
    for n in range(1, 51):
        write_atomic(folder / f"step_{n}.jsonl", [b"{}\n"])
    assert listed.count(folder) == 1
    assert not dead.exists() and live.exists()
