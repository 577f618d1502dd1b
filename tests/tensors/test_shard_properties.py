"""Property tests of ``TrainBatch.shard``: every row once, whole groups where they fit, tokens balanced.

Batches are built directly (text rows of random lengths in groups of random sizes), so each
example costs microseconds; the reference is the row multiset and the per-shard token loads.
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gymbridge.tensors import TrainBatch


def text_batch(groups: list[list[int]]) -> TrainBatch:
    """One row per entry of ``groups[g]`` (its token count), rows of a group consecutive."""
    lengths = [n for g in groups for n in g]
    b, width = len(lengths), max(lengths, default=1)
    attention = torch.zeros(b, width, dtype=torch.int64)
    for r, n in enumerate(lengths):
        attention[r, :n] = 1
    f = torch.zeros(b, width)
    return TrainBatch(
        input_ids=attention * 7,
        attention_mask=attention,
        loss_mask=attention.float(),
        logprobs=f,
        advantages=torch.zeros(b),
        rewards=torch.zeros(b),
        group_ids=torch.tensor([g for g, rows in enumerate(groups) for _ in rows], dtype=torch.int64),
        sample_ids=torch.arange(b),
        segment_ids=torch.zeros(b, dtype=torch.int64),
        sample_mask=torch.ones(b, dtype=torch.bool),
        media={},
        metadata=tuple({} for _ in range(b)),
    )


group_lengths = st.lists(st.lists(st.integers(1, 64), min_size=1, max_size=8), min_size=0, max_size=10)


@settings(max_examples=200, deadline=None)
@given(groups=group_lengths, num_shards=st.integers(1, 6), group_aware=st.booleans())
def test_every_row_once_and_token_loads_bounded(
    groups: list[list[int]], num_shards: int, group_aware: bool
) -> None:
    batch = text_batch(groups)
    shards = batch.shard(num_shards, group_aware=group_aware)
    assert len(shards) == num_shards
    seen = torch.cat([s.sample_ids for s in shards]).tolist() if shards else []
    assert sorted(seen) == list(range(len(batch)))  # every row exactly once
    for s in shards:
        assert s.sample_ids.tolist() == sorted(s.sample_ids.tolist())  # batch order kept
    loads = [int(s.lengths.sum()) for s in shards]
    longest_row = max((n for g in groups for n in g), default=0)
    units = [sum(g) for g in groups] if group_aware else [n for g in groups for n in g]
    # whole units land within target + max_row / 2; split units fill to one level at row
    # boundaries: no shard is more than two of the longest rows or the heaviest whole unit above another
    fit = sum(units) / num_shards + longest_row
    bound = max(2 * longest_row, max((u for u in units if u <= fit), default=0))
    assert max(loads) - min(loads) <= bound, (loads, groups)


@settings(max_examples=100, deadline=None)
@given(
    rows_per_group=st.integers(1, 8),
    row_len=st.integers(1, 40),
    per_shard=st.integers(1, 4),
    num_shards=st.integers(1, 5),
)
def test_groups_are_not_split_when_they_divide_evenly(
    rows_per_group: int, row_len: int, per_shard: int, num_shards: int
) -> None:
    groups = [[row_len] * rows_per_group for _ in range(per_shard * num_shards)]
    shards = text_batch(groups).shard(num_shards)
    homes: dict[int, set[int]] = {}
    for i, s in enumerate(shards):
        for g in s.group_ids.tolist():
            homes.setdefault(int(g), set()).add(i)
    assert all(len(h) == 1 for h in homes.values())
    assert len({int(s.lengths.sum()) for s in shards}) == 1  # and perfectly balanced


@given(lengths=st.lists(st.integers(1, 50), min_size=2, max_size=12))
@settings(max_examples=100, deadline=None)
def test_a_group_heavier_than_a_shard_is_split_by_tokens(lengths: list[int]) -> None:
    """One group, two shards: its rows go to both, the loads within one row of each other."""
    shards = text_batch([lengths]).shard(2)
    loads: list[Any] = [int(s.lengths.sum()) for s in shards]
    assert abs(loads[0] - loads[1]) <= max(lengths)
    assert all(len(s) for s in shards)
