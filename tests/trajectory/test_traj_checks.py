"""count_placeholders: runs vs tokens."""

from __future__ import annotations

import pytest

from gymbridge.trajectory import count_placeholders


@pytest.mark.parametrize(
    ("tokens", "runs", "singles"),
    [
        ([], 0, 0),
        ([1, 2, 3], 0, 0),
        ([7], 1, 1),
        ([1, 7, 7, 7, 2], 1, 3),
        ([7, 7, 1, 7, 2, 7, 7], 3, 5),
    ],
)
def test_count_placeholders(tokens: list[int], runs: int, singles: int) -> None:
    assert count_placeholders(tokens, 7) == runs
    assert count_placeholders(tokens, 7, count="token") == singles
