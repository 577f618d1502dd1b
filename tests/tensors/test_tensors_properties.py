"""Property tests: random rows and random op sequences vs a plain list-of-lists reference model.

For random rows and sequences of repeat / select / cat / shard / to / pickle:
``materialize()`` equals the same operations applied to a list of rows of
(tensor, provenance); physical bytes never exceed the unique bytes referenced
(they are equal: segments are compacted); every provenance appears once; dedup
on and off materialise to identical tensors.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gymbridge.tensors import PackedTensor, derive_provenance

Ref = list[list[tuple[torch.Tensor, str]]]

ops = st.lists(
    st.one_of(
        st.tuples(st.just("repeat"), st.integers(0, 3)),
        st.tuples(st.just("repeat_each"), st.lists(st.integers(0, 2), min_size=0, max_size=8)),
        st.tuples(st.just("select"), st.lists(st.integers(-50, 50), max_size=8)),
        st.tuples(st.just("slice"), st.integers(-4, 4), st.integers(-4, 8)),
        st.tuples(
            st.just("slice_step"),
            st.none() | st.integers(-8, 8),
            st.none() | st.integers(-8, 8),
            st.sampled_from([-3, -2, -1, 1, 2, 3]),
        ),
        st.tuples(st.just("cat_self"), st.lists(st.integers(0, 50), max_size=5)),
        st.tuples(st.just("cat_copies"), st.lists(st.integers(0, 50), max_size=5)),
        st.tuples(st.just("shard_pick"), st.integers(1, 4), st.integers(0, 3)),
        st.tuples(st.just("shard_cat"), st.integers(1, 4)),
        st.tuples(st.just("to_dtype"), st.sampled_from([torch.float64, torch.bfloat16, torch.float32])),
        st.tuples(st.just("to_device")),
        st.tuples(st.just("pickle"), st.sampled_from([4, 5])),
        st.tuples(st.just("compact")),
    ),
    max_size=6,
)


@st.composite
def rows_and_pool(draw: Any) -> tuple[list[torch.Tensor], list[list[int]], bool, int]:
    width = draw(st.integers(1, 3))
    sizes = draw(st.lists(st.integers(0, 3), min_size=1, max_size=5))
    pool = [
        torch.arange(n * width, dtype=torch.float32).reshape(n, width) + 100 * i for i, n in enumerate(sizes)
    ]
    rows = draw(st.lists(st.lists(st.integers(0, len(pool) - 1), max_size=3), max_size=6))
    return pool, rows, draw(st.booleans()), width


def _dense(ref: Ref) -> torch.Tensor | None:
    parts = [t for row in ref for t, _ in row]
    return torch.cat(parts) if parts else None


def _apply(op: tuple[Any, ...], pt: PackedTensor, ref: Ref) -> tuple[PackedTensor, Ref]:
    name = op[0]
    n = len(ref)
    if name == "repeat":
        return pt.repeat_interleave(op[1]), [row for row in ref for _ in range(op[1])]
    if name == "repeat_each":
        reps = (op[1] + [1] * n)[:n]
        return pt.repeat_interleave(torch.tensor(reps, dtype=torch.int64)), [
            row for row, k in zip(ref, reps, strict=True) for _ in range(k)
        ]
    if name == "select":
        idx = [i % n for i in op[1]] if n else []
        return pt.select(idx), [ref[i] for i in idx]
    if name == "slice":
        sl = slice(op[1], op[2])
        return pt[sl], ref[sl]
    if name == "slice_step":
        sl = slice(op[1], op[2], op[3])
        return pt[sl], ref[sl]
    if name == "cat_copies":
        # separately loaded copies (new objects, equal provenance) merge into the existing segments
        idx = [i % n for i in op[1]] if n else []
        copies = PackedTensor.from_rows(
            [[t.clone() for t in pt.row(i)] for i in idx],
            [[pt.provenance[int(j)] for j in pt.refs[pt.offsets[i] : pt.offsets[i + 1]]] for i in idx],
        )
        return PackedTensor.cat([pt, copies]), ref + [ref[i] for i in idx]
    if name == "cat_self":
        idx = [i % n for i in op[1]] if n else []
        return PackedTensor.cat([pt, pt.select(idx)]), ref + [ref[i] for i in idx]
    if name == "shard_pick":
        k, j = op[1], op[2] % op[1]
        bounds = [len(p) for p in torch.tensor_split(torch.arange(n), k)]
        lo = sum(bounds[:j])
        return pt.shard(k)[j], ref[lo : lo + bounds[j]]
    if name == "shard_cat":
        return PackedTensor.cat(pt.shard(op[1])), ref
    if name == "to_dtype":
        dtype = op[1]

        def cast(t: torch.Tensor, p: str) -> tuple[torch.Tensor, str]:
            if t.dtype == dtype:
                return t, p
            return t.to(dtype), derive_provenance(p, "cast", str(dtype))

        return pt.to(dtype), [[cast(t, p) for t, p in row] for row in ref]
    if name == "to_device":
        return pt.to("cpu"), ref
    if name == "pickle":
        buffers: list[pickle.PickleBuffer] = []
        data = pickle.dumps(pt, protocol=op[1], buffer_callback=buffers.append if op[1] >= 5 else None)
        return pickle.loads(data, buffers=buffers), ref
    if name == "compact":
        return pt.compact(), ref
    raise AssertionError(name)


def _check(pt: PackedTensor, ref: Ref, *, dedup: bool) -> None:
    assert len(pt) == len(ref)
    assert pt.segment_counts().tolist() == [len(row) for row in ref]
    dense, expected = pt.materialize(), _dense(ref)
    if expected is None:
        assert dense is None
    else:
        assert dense is not None and dense.dtype == expected.dtype and torch.equal(dense, expected)
    assert len(set(pt.provenance)) == len(pt.provenance)
    assert pt.logical_nbytes == sum(t.numel() * t.element_size() for row in ref for t, _ in row)
    if dedup:
        unique = {p: t.numel() * t.element_size() for row in ref for t, p in row}
        assert pt.physical_nbytes <= sum(unique.values())
        assert sorted(pt.provenance) == sorted(unique)
        for r, row in enumerate(ref):
            assert [pt.provenance[int(j)] for j in pt.refs[pt.offsets[r] : pt.offsets[r + 1]]] == [
                p for _, p in row
            ]


@settings(max_examples=150, deadline=None)
@given(data=rows_and_pool(), sequence=ops)
def test_random_op_sequences_match_list_reference(
    data: tuple[list[torch.Tensor], list[list[int]], bool, int], sequence: list[tuple[Any, ...]]
) -> None:
    pool, rows, explicit_provenance, _ = data
    tensor_rows = [[pool[i] for i in row] for row in rows]
    prov = [[f"p{i}" for i in row] for row in rows] if explicit_provenance else None
    pt = PackedTensor.from_rows(tensor_rows, prov)
    off = PackedTensor.from_rows(tensor_rows, prov, dedup=False)
    assert pt.num_segments == len({i for row in rows for i in row})
    # The reference comes from the inputs, not from pt: pool tensors and their ids. Without
    # explicit provenance, the id minted for a pool tensor is found by object identity (the
    # very object must be the stored segment: same object in several rows -> stored once).
    minted = {id(seg): pid for seg, pid in zip(pt.segments, pt.provenance, strict=True)}
    ref: Ref = [
        [(pool[i], f"p{i}" if explicit_provenance else minted[id(pool[i])]) for i in row] for row in rows
    ]
    off_ref: Ref = [[(t, "") for t, _ in row] for row in ref]
    assert off.num_segments == off.num_refs  # dedup off: one copied segment per reference
    _check(pt, ref, dedup=True)
    for op in sequence:
        pt, new_ref = _apply(op, pt, ref)
        off, off_ref = _apply(op, off, off_ref) if op[0] != "to_dtype" else (off.to(op[1]), new_ref)
        ref = new_ref
        _check(pt, ref, dedup=True)
        _check(off, ref, dedup=False)
        a, b = pt.materialize(), off.materialize()
        assert (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
