"""pass@k, pass@1[avg-of-k] and majority@k: hand-computed cases, properties, and the summary lines.

The same function against genuine NeMo Gym 0.7.0 is ``tests/gym/test_gym_passk_genuine.py``.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gymbridge.metrics import headline, pass_majority_metrics, summary_lines


def _tasks(*rewards: list[Any]) -> list[list[dict[str, Any]]]:
    return [[{"reward": r} for r in task] for task in rewards]


def _voted(*pairs: list[tuple[Any, Any]]) -> list[list[dict[str, Any]]]:
    """Tasks of (reward, answer) pairs; answer ``None`` is a rollout without an answer."""
    return [[{"reward": r, "answer": a} for r, a in task] for task in pairs]


def _approx(expected: dict[str, float]) -> Any:
    return pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_binary_scores_use_the_unbiased_estimator_over_all_rollouts() -> None:
    got = pass_majority_metrics(_tasks([1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]))
    runs = [200 / 3, 100 / 3, 100 / 3, 200 / 3]  # run j: rollout j of every task, in percent
    expected = {
        "pass@1/accuracy": 100 * (1 / 2 + 0 + 1) / 3,
        "pass@2/accuracy": 100 * ((1 - 1 / 6) + 0 + 1) / 3,  # 1 - C(2,2)/C(4,2) for the first task
        "pass@3/accuracy": 100 * (1 + 0 + 1) / 3,  # 2 wrong < 3 drawn: a success is certain
        "pass@4/accuracy": 100 * 2 / 3,
        "pass@1[avg-of-1]/accuracy": 100 * 2 / 3,
        "pass@1[avg-of-2]/accuracy": 100 * (1 / 2 + 0 + 1) / 3,
        "pass@1[avg-of-3]/accuracy": 100 * (1 / 3 + 0 + 1) / 3,
        "pass@1[avg-of-4]/accuracy": 100 * (1 / 2 + 0 + 1) / 3,
    }
    for k in (2, 3, 4):
        std = _stdev(runs[:k])
        expected[f"pass@1[avg-of-{k}]/accuracy/std_dev_across_runs"] = std
        expected[f"pass@1[avg-of-{k}]/accuracy/std_err_across_runs"] = std / math.sqrt(k)
    assert got == _approx(expected)


def _stdev(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def test_continuous_scores_take_the_best_of_the_first_k() -> None:
    got = pass_majority_metrics(_tasks([0.2, 0.9, 0.5], [0.5, 0.5, 0.5]))
    assert got["pass@1/accuracy"] == pytest.approx(35.0)
    assert got["pass@2/accuracy"] == pytest.approx(70.0)
    assert got["pass@3/accuracy"] == pytest.approx(70.0)
    assert got["pass@1[avg-of-2]/accuracy"] == pytest.approx(100 * (0.55 + 0.5) / 2)


def test_binary_or_continuous_is_decided_per_task() -> None:
    got = pass_majority_metrics(_tasks([1, 0], [0.5, 0.25]))
    # first task: 1 - C(1,1)/C(2,1) = 1/2; second: max(0.5) = 0.5, then max(0.5, 0.25)
    assert got["pass@1/accuracy"] == pytest.approx(50.0)
    assert got["pass@2/accuracy"] == pytest.approx(100 * (1 + 0.5) / 2)


def test_bools_count_as_zero_and_one() -> None:
    assert pass_majority_metrics(_tasks([True, False], [False, False])) == pass_majority_metrics(
        _tasks([1, 0], [0, 0])
    )


def test_tasks_with_fewer_rollouts_than_k_leave_pass_at_k_but_not_the_average() -> None:
    got = pass_majority_metrics(_tasks([1, 0, 0], [1]))
    assert got["pass@1/accuracy"] == pytest.approx(100 * (1 / 3 + 1) / 2)
    assert got["pass@2/accuracy"] == pytest.approx(100 * 2 / 3)  # the second task is left out
    assert got["pass@3/accuracy"] == pytest.approx(100.0)
    assert got["pass@1[avg-of-3]/accuracy"] == pytest.approx(100 * (1 / 3 + 1) / 2)  # on what it has
    # runs: rollout 0 of both tasks (100%), rollout 1 and 2 of the first only (0%)
    assert got["pass@1[avg-of-2]/accuracy/std_dev_across_runs"] == pytest.approx(_stdev([100.0, 0.0]))
    assert got["pass@1[avg-of-3]/accuracy/std_err_across_runs"] == pytest.approx(
        _stdev([100.0, 0.0, 0.0]) / math.sqrt(3)
    )


def test_majority_votes_with_answer_and_score_pairs_and_averages_ties() -> None:
    got = pass_majority_metrics(
        _voted(
            [(1, "a"), (0, "b")],  # a tie of two pairs: (1 + 0) / 2
            [(0, "x"), (0, "x"), (1, "y")],  # x wins
            [(1, "a"), (0, "a"), (0, "a")],  # one answer, two scores: (a, 0) wins at k=3
        ),
        answer_key="answer",
    )
    assert got["majority@1/accuracy"] == pytest.approx(100 * (1 + 0 + 1) / 3)
    assert got["majority@2/accuracy"] == pytest.approx(100 * (0.5 + 0 + 0.5) / 3)
    assert got["majority@3/accuracy"] == pytest.approx(100 * (0.5 + 0 + 0) / 3)


def test_rollouts_without_an_answer_abstain_and_count_as_no_answer() -> None:
    got = pass_majority_metrics(
        _voted([(1, None), (0, None)], [(0, None), (1, "y")]),
        answer_key="answer",
    )
    # nobody answered the first task: 0; the second: only (y, 1) votes
    assert got["majority@2/accuracy"] == pytest.approx(100 * (0 + 1) / 2)
    assert got["pass@1[avg-of-2]/no_answer"] == pytest.approx(100 * (1 + 0.5) / 2)
    assert got["pass@2/no_answer"] == pytest.approx(100.0)
    assert got["majority@2/no_answer"] == 0.0  # answered votes carry no_answer = 0 by construction
    assert "majority@1/no_answer" in got and "pass@1[avg-of-1]/no_answer/std_dev_across_runs" not in got


def test_key_set_with_an_answer_key() -> None:
    got = pass_majority_metrics(_voted([(1, "a"), (0, None)]), answer_key="answer")
    stats = ("std_dev_across_runs", "std_err_across_runs")
    expected = {
        f"{aggregate}/{name}"
        for name in ("accuracy", "no_answer")
        for k in (1, 2)
        for aggregate in (f"pass@{k}", f"pass@1[avg-of-{k}]", f"majority@{k}")
    } | {f"pass@1[avg-of-2]/{name}/{stat}" for name in ("accuracy", "no_answer") for stat in stats}
    assert set(got) == expected


def test_score_fn_names_scores_and_may_leave_one_out() -> None:
    def score(result: dict[str, Any]) -> dict[str, Any]:
        return {"accuracy": result["reward"], **({"strict": result["strict"]} if "strict" in result else {})}

    tasks = [[{"reward": 1, "strict": 0}, {"reward": 1}], [{"reward": 0}, {"reward": 1, "strict": 1}]]
    got = pass_majority_metrics(tasks, score_fn=score)
    assert got["pass@1[avg-of-1]/strict"] == pytest.approx(0.0)  # rollout 0 of task 1 has no strict
    assert got["pass@1[avg-of-2]/strict"] == pytest.approx(100 * (0 + 1) / 2)
    assert "pass@2/strict" not in got  # no task has two strict scores
    assert got["pass@1/strict"] == pytest.approx(50.0)


def test_empty_input_gives_no_metrics() -> None:
    assert pass_majority_metrics([]) == {}
    assert pass_majority_metrics([[]]) == {}
    assert pass_majority_metrics([[]], answer_key="answer") == {}


def test_a_result_without_reward_or_with_a_non_number_score_is_refused() -> None:
    with pytest.raises(KeyError):
        pass_majority_metrics([[{"score": 1}]])
    with pytest.raises(TypeError, match="score 'accuracy' of task 1 rollout 0 is None"):
        pass_majority_metrics(_tasks([1], [None]))


# ---------------------------------------------------------------- properties

binary_groups = st.integers(1, 6).flatmap(
    lambda n: st.lists(st.lists(st.sampled_from([0, 1, True, False]), min_size=n, max_size=n), min_size=1)
)
any_groups = st.lists(
    st.lists(st.one_of(st.sampled_from([0, 1]), st.floats(0, 1)), min_size=0, max_size=6), min_size=1
)


@given(any_groups)
def test_every_value_is_a_percentage(groups: list[list[float]]) -> None:
    for key, value in pass_majority_metrics(_tasks(*groups)).items():
        assert -1e-9 <= value <= 100 + 1e-9, key


@given(binary_groups)
def test_binary_pass_at_k_never_falls_as_k_grows(groups: list[list[int]]) -> None:
    got = pass_majority_metrics(_tasks(*groups))
    at_k = [got[f"pass@{k}/accuracy"] for k in range(1, len(groups[0]) + 1)]
    assert all(a <= b + 1e-9 for a, b in itertools.pairwise(at_k))
    # with equal groups, pass@1 is the mean of every score
    assert at_k[0] == pytest.approx(got[f"pass@1[avg-of-{len(groups[0])}]/accuracy"])


@given(any_groups)
def test_avg_of_1_is_the_mean_of_each_tasks_first_rollout(groups: list[list[float]]) -> None:
    got = pass_majority_metrics(_tasks(*groups))
    firsts = [float(g[0]) for g in groups if g]
    if firsts:
        assert got["pass@1[avg-of-1]/accuracy"] == pytest.approx(100 * sum(firsts) / len(firsts))
    else:
        assert got == {}


# ---------------------------------------------------------------- headline and summary lines


def test_headline_picks_the_largest_k_and_no_answer_last() -> None:
    metrics = pass_majority_metrics(
        _voted([(1, "a"), (0, "b"), (1, "a")], [(0, None), (1, "c"), (0, "c")]), answer_key="answer"
    )
    assert list(headline(metrics)) == [
        "pass@1[avg-of-3]/accuracy",
        "pass@3/accuracy",
        "majority@3/accuracy",
        "pass@1[avg-of-3]/no_answer",
    ]
    assert list(headline(metrics, 2)) == [
        "pass@1[avg-of-2]/accuracy",
        "pass@2/accuracy",
        "majority@2/accuracy",
        "pass@1[avg-of-2]/no_answer",
    ]
    assert headline(metrics, 8) == headline(metrics)  # no more than the largest k present
    assert headline({}) == {}


def test_summary_lines_show_percentages_and_the_standard_error() -> None:
    metrics = pass_majority_metrics(_voted([(1, "a"), (0, "b")], [(1, "a"), (1, None)]), answer_key="answer")
    assert summary_lines(metrics) == [
        "accuracy:  pass@1[avg-of-2] 75.00% (s.e. 25.00), pass@2 100.00%, majority@2 75.00%",
        "no_answer: pass@1[avg-of-2] 25.00% (s.e. 25.00)",
    ]
    assert summary_lines(pass_majority_metrics(_tasks([0.5])), k=1) == [
        "accuracy: pass@1[avg-of-1] 50.00%, pass@1 50.00%"
    ]
    assert summary_lines({}) == ["pass@k: no scored rollouts"]
