"""PackedTensor unit tests: construction, reads, transforms, provenance, read-only segments, pickling."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from gymbridge.tensors import PackedTensor, derive_provenance


def _seg(n: int, d: int = 3, start: float = 0.0) -> torch.Tensor:
    return torch.arange(n * d, dtype=torch.float32).reshape(n, d) + start


@pytest.fixture
def abc() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _seg(2), _seg(1, start=100.0), _seg(3, start=200.0)


@pytest.fixture
def packed(abc: tuple[torch.Tensor, ...]) -> PackedTensor:
    a, b, c = abc
    return PackedTensor.from_rows([[a], [a, b], [], [c, a]])


def test_same_object_is_stored_once(packed: PackedTensor, abc: tuple[torch.Tensor, ...]) -> None:
    a, b, c = abc
    assert len(packed) == 4
    assert packed.num_segments == 3 and packed.num_refs == 5
    assert packed.segment_counts().tolist() == [1, 2, 0, 2]
    assert packed.row(1)[0] is packed.row(0)[0] is packed.row(3)[1]
    assert packed.physical_nbytes == (2 + 1 + 3) * 3 * 4
    assert packed.logical_nbytes == (2 + 2 + 1 + 3 + 2) * 3 * 4
    assert torch.equal(packed.materialize(), torch.cat([a, a, b, c, a]))
    assert packed.offsets.dtype == packed.refs.dtype == torch.int64


def test_equal_provenance_merges_distinct_objects_and_collisions_are_refused() -> None:
    a1, a2 = _seg(2), _seg(2)
    merged = PackedTensor.from_rows([[a1], [a2]], provenance=[["img"], ["img"]])
    assert merged.num_segments == 1 and merged.provenance == ("img",)
    same_values = PackedTensor.from_rows([[a1], [a2]])
    assert same_values.num_segments == 2  # equal values are no evidence: only provenance merges
    with pytest.raises(ValueError, match="different shape"):
        PackedTensor.from_rows([[a1], [_seg(3)]], provenance=[["img"], ["img"]])


def test_empty_and_one_row() -> None:
    empty = PackedTensor.from_rows([])
    assert len(empty) == 0 and empty.materialize() is None and empty.physical_nbytes == 0
    assert len(empty.select([])) == 0 and len(empty.repeat_interleave(3)) == 0
    rows_of_nothing = PackedTensor.from_rows([[], []])
    assert len(rows_of_nothing) == 2 and rows_of_nothing.materialize() is None
    assert [len(s) for s in rows_of_nothing.shard(3)] == [1, 1, 0]
    one = PackedTensor.from_rows([[_seg(2)]])
    assert len(one) == 1 and one.materialize().shape == (2, 3)
    assert torch.equal(one[0].materialize(), one.materialize())


def test_ragged_shapes_need_padding() -> None:
    a = torch.ones(2, 3)
    b = torch.full((1, 5), 2.0)
    pt = PackedTensor.from_rows([[a], [b, a]])
    with pytest.raises(ValueError, match="pad=True"):
        pt.materialize()
    dense = pt.materialize(pad=True, pad_value=-1.0)
    assert dense is not None and dense.shape == (5, 5)
    assert torch.equal(dense[0], torch.tensor([1.0, 1, 1, -1, -1]))
    assert torch.equal(dense[2], torch.full((5,), 2.0))
    assert a.shape == (2, 3)  # the segment itself was not padded in place


def test_pack_dim_1() -> None:
    a = torch.arange(6.0).reshape(2, 3)
    b = torch.arange(4.0).reshape(2, 2) + 10
    pt = PackedTensor.from_rows([[a, b], [b]], pack_dim=1)
    assert torch.equal(pt.materialize(), torch.cat([a, b, b], dim=1))
    assert torch.equal(pt.select([1, 0]).materialize(), torch.cat([b, a, b], dim=1))
    with pytest.raises(ValueError, match="pack_dim"):
        PackedTensor.from_rows([[torch.ones(3)]], pack_dim=1)


def test_integer_metadata_keys_are_never_cast() -> None:
    grid = torch.tensor([[1, 4, 4]])
    pt = PackedTensor.from_rows([[grid], [grid]], provenance=[["g"], ["g"]])
    cast = pt.to(torch.bfloat16)
    assert cast.dtype == torch.int64 and cast.provenance == ("g",)
    assert torch.equal(cast.materialize(), torch.tensor([[1, 4, 4], [1, 4, 4]]))
    with pytest.raises(ValueError, match="floating"):
        pt.to(torch.int32)


def test_dtype_cast_provenance() -> None:
    a = _seg(2)
    pt = PackedTensor.from_rows([[a], [a]], provenance=[["p"], ["p"]])
    bf = pt.to(dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16
    assert bf.provenance[0] != "p"
    assert bf.provenance[0] == derive_provenance("p", "cast", "torch.bfloat16")
    # two shards cast independently still merge: the new id is derived, not random
    s0, s1 = pt.shard(2)
    merged = PackedTensor.cat([s0.to(torch.bfloat16), s1.to(torch.bfloat16)])
    assert merged.num_segments == 1
    # casting to the current dtype is value-preserving: same id, same tensor
    same = pt.to(torch.float32)
    assert same.provenance == ("p",) and same.segments[0] is a
    # a cast copy never carries the original's id, and mixing dtypes in one PackedTensor is refused
    assert set(pt.to(torch.float64).provenance).isdisjoint(pt.provenance)
    with pytest.raises(ValueError, match="float64"):
        PackedTensor.cat([pt, pt.to(torch.float64)])
    moved = pt.to("cpu")
    assert moved.provenance == pt.provenance


def test_indexing_forms(packed: PackedTensor) -> None:
    full = [r for r in packed.rows()]
    assert [len(r) for r in packed[1:3].rows()] == [2, 0]
    assert [len(r) for r in packed[-1].rows()] == [2]
    assert [len(r) for r in packed[torch.tensor([3, 3, 0])].rows()] == [2, 2, 1]
    mask = torch.tensor([True, False, False, True])
    assert [len(r) for r in packed[mask].rows()] == [1, 2]
    assert [len(r) for r in packed[[True, False, True, False]].rows()] == [1, 0]
    assert [len(r) for r in packed[np.array([3, 1])].rows()] == [2, 2]
    assert [len(r) for r in packed[np.int64(1)].rows()] == [2]
    assert len(packed[[]]) == 0
    with pytest.raises(IndexError, match="integers"):
        packed.select([0.5])
    assert packed.select([0]).num_segments == 1  # unreferenced segments dropped
    assert packed.select([3, 1]).row(0)[0] is full[3][0]
    with pytest.raises(IndexError):
        packed.select([4])
    with pytest.raises(IndexError):
        packed.select(torch.tensor([True]))
    with pytest.raises(IndexError):
        packed.row(-5)


def test_repeat_interleave_and_shard_and_cat(packed: PackedTensor) -> None:
    rep = packed.repeat_interleave(3)
    assert len(rep) == 12 and rep.num_segments == packed.num_segments
    assert rep.logical_nbytes == 3 * packed.logical_nbytes and rep.physical_nbytes == packed.physical_nbytes
    per_row = packed.repeat_interleave(torch.tensor([0, 2, 1, 0]))
    assert per_row.segment_counts().tolist() == [2, 2, 0]
    shards = rep.shard(5)
    assert [len(s) for s in shards] == [3, 3, 2, 2, 2]
    back = PackedTensor.cat(shards)
    assert back.num_segments == packed.num_segments
    assert torch.equal(back.materialize(), rep.materialize())
    with pytest.raises(ValueError, match="pack_dim"):
        PackedTensor.cat([packed, PackedTensor.empty(1, pack_dim=1)])


def test_constructor_enforces_invariants() -> None:
    a = _seg(1)
    i64 = torch.int64
    with pytest.raises(ValueError, match="start at 0"):
        PackedTensor([a], ["x"], torch.tensor([1, 1], dtype=i64), torch.tensor([0], dtype=i64))
    with pytest.raises(ValueError, match="never decrease"):
        PackedTensor([a], ["x"], torch.tensor([0, 1, 0, 1], dtype=i64), torch.tensor([0], dtype=i64))
    with pytest.raises(ValueError, match="refs out of range"):
        PackedTensor([a], ["x"], torch.tensor([0, 1], dtype=i64), torch.tensor([1], dtype=i64))
    with pytest.raises(ValueError, match="unique"):
        PackedTensor([a, a], ["x", "x"], torch.tensor([0, 1], dtype=i64), torch.tensor([0], dtype=i64))
    with pytest.raises(ValueError, match="segment 1"):
        PackedTensor([a, a.double()], ["x", "y"], torch.tensor([0, 0], dtype=i64), torch.zeros(0, dtype=i64))


def test_no_operation_writes_into_a_segment(packed: PackedTensor) -> None:
    before = [s.clone() for s in packed.segments]
    ptrs = [s.data_ptr() for s in packed.segments]
    results = [
        packed.select([3, 0, 0]),
        packed.repeat_interleave(4),
        PackedTensor.cat([packed, packed.select([1])]),
        *packed.shard(3),
        packed.compact(),
        packed.to("cpu"),
        packed.to(torch.bfloat16),
        packed.unshared(),
        pickle.loads(pickle.dumps(packed, protocol=5)),
    ]
    for r in results:
        dense = r.materialize(pad=True)
        if dense is not None:
            dense.mul_(0)  # a consumer mutating its dense copy must not reach the segments
    for s, b, p in zip(packed.segments, before, ptrs, strict=True):
        assert torch.equal(s, b) and s.data_ptr() == p
    # value-preserving ops share the very same storage (no copies)
    rep = packed.repeat_interleave(2)
    assert {s.data_ptr() for s in rep.segments} == set(ptrs)


def test_unshared_is_the_dedup_off_twin(packed: PackedTensor) -> None:
    off = packed.unshared()
    assert off.num_segments == off.num_refs == packed.num_refs
    assert set(off.provenance).isdisjoint(packed.provenance)
    assert torch.equal(off.materialize(), packed.materialize())
    assert off.physical_nbytes == packed.logical_nbytes


def test_pickle5_keeps_sharing_and_provenance_out_of_band(packed: PackedTensor) -> None:
    big = PackedTensor.from_rows([[torch.randn(256, 64)]] * 8)
    buffers: list[pickle.PickleBuffer] = []
    stream = pickle.dumps(big, protocol=5, buffer_callback=buffers.append)
    oob = sum(memoryview(b).nbytes for b in buffers)
    assert oob >= big.physical_nbytes  # the segment's storage travelled out of band, once
    assert oob < 2 * big.physical_nbytes
    assert len(stream) < 4096  # the in-band stream is metadata only
    back = pickle.loads(stream, buffers=buffers)
    assert back.provenance == big.provenance and back.num_segments == 1 and len(back) == 8
    assert torch.equal(back.materialize(), big.materialize())
    for protocol in (2, 4, 5):
        again = pickle.loads(pickle.dumps(packed, protocol=protocol))
        assert again.provenance == packed.provenance
        assert torch.equal(again.offsets, packed.offsets) and torch.equal(again.refs, packed.refs)
        assert torch.equal(again.materialize(), packed.materialize())


def test_pickle_roundtrips_bf16_and_bool_and_empty() -> None:
    bf = torch.randn(3, 4).to(torch.bfloat16)
    flags = torch.tensor([[True, False]])
    for t in (bf, flags, torch.zeros(0, 4)):
        pt = PackedTensor.from_rows([[t], [t]])
        back = pickle.loads(pickle.dumps(pt, protocol=5))
        assert back.dtype == t.dtype
        assert torch.equal(back.segments[0], t)


@pytest.mark.gpu
def test_to_cuda_keeps_provenance_and_pickles_back() -> None:
    a = _seg(4)
    pt = PackedTensor.from_rows([[a], [a]], provenance=[["p"], ["p"]])
    gpu = pt.to("cuda")
    assert gpu.device is not None and gpu.device.type == "cuda" and gpu.provenance == ("p",)
    assert gpu.offsets.device.type == "cpu"  # index metadata stays on the host
    assert torch.equal(gpu.materialize().cpu(), pt.materialize())
    back = pickle.loads(pickle.dumps(gpu, protocol=5))
    assert back.device.type == "cuda" and back.provenance == ("p",)
    bf = gpu.to(torch.bfloat16)
    assert bf.provenance == pt.to(torch.bfloat16).provenance
