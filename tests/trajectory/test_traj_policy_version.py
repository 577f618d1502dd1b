"""Policy versions on turns: parsed from the item field, absent on genuine servers, checked."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from traj_helpers import assistant, result, tok, user_msg

from gymbridge.errors import TrajectoryError
from gymbridge.trajectory import from_gym_result


def two_turns(v0: Any, v1: Any) -> list[dict[str, Any]]:
    first = assistant("a", **tok([1], [2]))
    second = assistant("b", **tok([1, 2, 3], [4]))
    if v0 is not None:
        first["policy_version"] = v0
    if v1 is not None:
        second["policy_version"] = v1
    return [first, user_msg("?"), second]


def test_turns_carry_the_item_policy_version() -> None:
    traj = from_gym_result(result(two_turns(3, 4)))
    assert [t.policy_version for t in traj.turns] == [3, 4]
    assert traj.policy_versions == [3, 4]
    assert traj.oldest_policy_version == 3


def test_genuine_items_without_a_version_give_none() -> None:
    traj = from_gym_result(result(two_turns(None, None)))
    assert [t.policy_version for t in traj.turns] == [None, None]
    assert traj.policy_versions == []
    assert traj.oldest_policy_version is None


def test_a_turn_without_a_version_is_left_out_of_the_versions() -> None:
    traj = from_gym_result(result(two_turns(None, 2)))
    assert traj.policy_versions == [2]
    assert traj.oldest_policy_version == 2


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_a_malformed_policy_version_is_refused_naming_the_item(bad: Any) -> None:
    with pytest.raises(TrajectoryError, match="policy_version") as info:
        from_gym_result(result(two_turns(0, bad)))
    assert info.value.item_index == 2


@given(st.lists(st.integers(min_value=0, max_value=10**6), min_size=1, max_size=6))
def test_oldest_is_the_minimum_in_turn_order(versions: list[int]) -> None:
    out: list[dict[str, Any]] = []
    prompt: list[int] = [1]
    for k, v in enumerate(versions):
        item = assistant(f"t{k}", **tok(list(prompt), [100 + k]))
        item["policy_version"] = v
        out.append(item)
        prompt = [*prompt, 100 + k, 7]
        out.append(user_msg("?"))
    traj = from_gym_result(result(out[:-1]))
    assert traj.policy_versions == versions
    assert traj.oldest_policy_version == min(versions)
