"""RowSet behaves as a set of ints for any sequence of adds and discards, and stays compact."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gymbridge.rowset import RowSet

ops = st.lists(st.tuples(st.sampled_from(["add", "discard", "range"]), st.integers(0, 60), st.integers(0, 8)))


@given(ops)
def test_rowset_matches_a_python_set_for_any_adds_and_discards(steps: list[tuple[str, int, int]]) -> None:
    rows, ref = RowSet(), set[int]()
    for op, x, n in steps:
        if op == "add":
            rows.add(x)
            ref.add(x)
        elif op == "discard":
            rows.discard(x)
            ref.discard(x)
        else:
            rows.add_range(x, x + n)
            ref.update(range(x, x + n))
    assert rows == ref and ref == rows
    assert len(rows) == len(ref)
    assert list(rows) == sorted(ref)
    assert all((i in rows) == (i in ref) for i in range(-2, 75))
    ranges = rows.ranges()
    # sorted, disjoint, never adjacent: the compact form
    assert all(a < b for a, b in ranges)
    assert all(ranges[i][1] < ranges[i + 1][0] for i in range(len(ranges) - 1))
    assert RowSet.from_ranges(orjson.loads(orjson.dumps(ranges))) == rows


@given(st.sets(st.integers(0, 200)), st.sets(st.integers(0, 200)))
def test_rowset_set_algebra_and_update(a: set[int], b: set[int]) -> None:
    ra, rb = RowSet(a), RowSet(b)
    assert ra | rb == a | b
    assert ra & rb == a & b
    merged = ra.copy()
    merged.update(rb)
    assert merged == a | b and ra == a


def test_rows_done_in_order_are_one_range() -> None:
    rows = RowSet()
    for i in reversed(range(100_000)):
        rows.add(i)
    assert rows.ranges() == [[0, 100_000]] and len(rows) == 100_000


@pytest.mark.parametrize("bad", [[[3, 1]], [[-1, 2]], [[0]], [["0", 1]], [[True, 2]]])
def test_malformed_ranges_are_refused(bad: list[list[object]]) -> None:
    with pytest.raises(ValueError, match="row range"):
        RowSet.from_ranges(bad)  # type: ignore[arg-type]


def test_negative_or_non_int_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="row index"):
        RowSet().add(-1)
    with pytest.raises(ValueError, match="row index"):
        RowSet().add(1.0)  # type: ignore[arg-type]
