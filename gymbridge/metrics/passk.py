"""pass@k, pass@1[avg-of-k] and majority@k over rollouts grouped by prompt, as NeMo Gym defines them.

``tasks[i]`` holds the results of prompt ``i`` in rollout order (rollout 0 first); a rollout's
named scores come from ``score_fn(result)``, by default ``{"accuracy": result["reward"]}`` (the
``reward`` field of a NeMo Gym ``/run`` result; bools count as 0/1). With ``K`` the most rollouts
of any prompt, :func:`pass_majority_metrics` returns, for every score name and ``k = 1..K``, keys
``{aggregate}/{name}``, every value a percentage (0-100):

* ``pass@{k}``: chance that at least one of ``k`` rollouts succeeds. Scores all 0/1 within a prompt:
  the unbiased estimate ``1 - C(wrong, k) / C(n, k)`` from all ``n`` rollouts of the prompt;
  otherwise the best of its first ``k`` scores. A prompt with fewer than ``k`` scores is left out.
* ``pass@1[avg-of-{k}]``: the mean score of each prompt's first ``k`` rollouts, averaged over prompts.
* ``pass@1[avg-of-{k}]/{name}/std_dev_across_runs`` and ``.../std_err_across_runs`` (``k >= 2``):
  sample standard deviation and standard error of the per-run means (run ``j`` = rollout ``j`` of
  every prompt, in percentage points) over the first ``k`` runs.
* with ``answer_key``, ``majority@{k}``: each prompt's first ``k`` rollouts vote with their
  (answer, score) pairs, rollouts without an answer abstaining; the most frequent pairs' mean
  score counts (ties averaged), a prompt where nobody answered counts 0. ``no_answer`` (1 when the
  ``answer_key`` field is missing or ``None``) joins the score names, so ``pass@{k}/no_answer``,
  ``pass@1[avg-of-{k}]/no_answer`` etc. exist too (``majority@{k}/no_answer`` is 0 by construction).

This is NeMo Gym 0.7.0's ``nemo_gym.reward_profile.compute_pass_majority_metrics`` (its metrics dict
without the ``per_sample_aggregate`` lists), key for key and value for value;
``tests/gym/test_gym_passk_genuine.py`` compares the two. Empty input gives ``{}``.
:func:`headline` picks the keys a console line shows, :func:`summary_lines` renders them.
Pure functions, no I/O, torch-free.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import orjson

__all__ = ["ScoreFn", "headline", "pass_majority_metrics", "summary_lines", "vote_key"]

ScoreFn = Callable[[Mapping[str, Any]], Mapping[str, Any]]
"""One result -> its named scores (numbers or bools)."""

NO_ANSWER = "no_answer"
STD_DEV_SUFFIX = "/std_dev_across_runs"
STD_ERR_SUFFIX = "/std_err_across_runs"

_KEY = re.compile(
    r"^(?:pass@(?P<pass>\d+)|pass@1\[avg-of-(?P<avg>\d+)\]|majority@(?P<maj>\d+))/(?P<name>.+)$"
)


def vote_key(answer: object) -> Hashable | None:
    """An answer as a majority vote compares it: a hashable one as it is, a list or object answer by
    its canonical JSON (NeMo Gym's vote needs hashable answers; callers normalise before scoring)."""
    if isinstance(answer, Hashable):
        try:
            hash(answer)  # a tuple may still hold a list
            return answer
        except TypeError:
            pass
    return orjson.dumps(answer, default=str, option=orjson.OPT_SORT_KEYS).decode()


def _reward_score(result: Mapping[str, Any]) -> Mapping[str, Any]:
    return {"accuracy": result["reward"]}


def _scores_of(score_fn: ScoreFn, result: Mapping[str, Any], where: tuple[int, int]) -> dict[str, float]:
    scores: dict[str, float] = {}
    for name, value in score_fn(result).items():
        if isinstance(value, bool):
            value = int(value)
        if not isinstance(value, int | float):
            task, rollout = where
            raise TypeError(
                f"score {name!r} of task {task} rollout {rollout} is {value!r}: not a number or bool"
            )
        scores[name] = value
    return scores


def _pass_at_k(values: Sequence[float], k: int) -> float:
    """One prompt's pass@k (as a fraction) from its scores in rollout order; ``len(values) >= k``."""
    if all(v == 0 or v == 1 for v in values):
        wrong = sum(1 for v in values if v == 0)
        if wrong < k:  # every draw of k holds a success
            return 1.0
        return 1.0 - math.comb(wrong, k) / math.comb(len(values), k)
    return max(values[:k])


def _majority(votes: Sequence[tuple[Hashable, float]]) -> float:
    """The mean score of the most frequent (answer, score) pairs; 0 when nobody answered."""
    if not votes:
        return 0
    counts = Counter(votes)
    top = max(counts.values())
    winners = [score for (_, score), count in counts.items() if count == top]
    return sum(winners) / len(winners)


def _percent_mean(values: Sequence[float]) -> float:
    return 100.0 * sum(values) / len(values)


def pass_majority_metrics(
    tasks: Sequence[Sequence[Mapping[str, Any]]],
    *,
    score_fn: ScoreFn | None = None,
    answer_key: str | None = None,
) -> dict[str, float]:
    """pass@k, pass@1[avg-of-k], majority@k (with ``answer_key``) and their spread; see the module.

    ``tasks[i]``: the results of prompt ``i``, rollout 0 first. Raises ``KeyError`` when the
    default score meets a result without ``reward``, ``TypeError`` when a score is not a number.
    """
    score = _reward_score if score_fn is None else score_fn
    scored: list[list[dict[str, float]]] = []
    answers: list[list[Hashable | None]] = []
    for t, rollouts in enumerate(tasks):
        task_scores: list[dict[str, float]] = []
        task_answers: list[Hashable | None] = []
        for r, result in enumerate(rollouts):
            scores = _scores_of(score, result, (t, r))
            if answer_key is not None:
                answer = result.get(answer_key)
                task_answers.append(answer)
                scores[NO_ANSWER] = int(answer is None)
            task_scores.append(scores)
        scored.append(task_scores)
        answers.append(task_answers)

    max_k = max((len(task) for task in scored), default=0)
    names = sorted({name for task in scored for scores in task for name in scores})
    metrics: dict[str, float] = {}
    for name in names:
        # each prompt's scores of this name in rollout order (a score_fn may omit a name)
        series = [[scores[name] for scores in task if name in scores] for task in scored]
        for k in range(1, max_k + 1):
            at_k = [_pass_at_k(values, k) for values in series if len(values) >= k]
            if at_k:
                metrics[f"pass@{k}/{name}"] = _percent_mean(at_k)
            firsts = [[scores[name] for scores in task[:k] if name in scores] for task in scored]
            means = [sum(values) / len(values) for values in firsts if values]
            if means:
                metrics[f"pass@1[avg-of-{k}]/{name}"] = _percent_mean(means)
            if answer_key is not None:
                votes = [
                    _majority(
                        [
                            (answer, scores[name])
                            for answer, scores in zip(task_answers[:k], task[:k], strict=True)
                            if answer is not None and name in scores
                        ]
                    )
                    for task, task_answers in zip(scored, answers, strict=True)
                ]
                if votes:
                    metrics[f"majority@{k}/{name}"] = _percent_mean(votes)

        run_means = []  # run j = rollout j of every prompt that has one scored under this name
        for j in range(max_k):
            run = [task[j][name] for task in scored if j < len(task) and name in task[j]]
            if run:
                run_means.append(_percent_mean(run))
        for k in range(2, max_k + 1):
            head = run_means[:k]
            if len(head) >= 2:
                spread = statistics.stdev(head)
                metrics[f"pass@1[avg-of-{k}]/{name}{STD_DEV_SUFFIX}"] = spread
                metrics[f"pass@1[avg-of-{k}]/{name}{STD_ERR_SUFFIX}"] = spread / math.sqrt(len(head))
    return metrics


def _largest_k(metrics: Mapping[str, float]) -> int | None:
    ks = [
        int(m["pass"] or m["avg"])
        for m in map(_KEY.match, metrics)
        if m is not None and (m["pass"] or m["avg"])
    ]
    return max(ks, default=None)


def _score_names(metrics: Mapping[str, float]) -> list[str]:
    names = {
        m["name"]
        for m in map(_KEY.match, metrics)
        if m is not None and not m["name"].endswith((STD_DEV_SUFFIX, STD_ERR_SUFFIX))
    }
    return sorted(names - {NO_ANSWER}) + ([NO_ANSWER] if NO_ANSWER in names else [])


def headline(metrics: Mapping[str, float], k: int | None = None) -> dict[str, float]:
    """The keys a console line shows, at ``k`` (default, and at most: the largest k in ``metrics``).

    Per score name: ``pass@1[avg-of-k]``, ``pass@k`` and ``majority@k`` where present; for
    ``no_answer`` only ``pass@1[avg-of-k]`` (the share of rollouts without an answer).
    Names in sorted order, ``no_answer`` last.
    """
    largest = _largest_k(metrics)
    if largest is None:
        return {}
    k = largest if k is None else min(k, largest)
    picked: dict[str, float] = {}
    for name in _score_names(metrics):
        aggregates = [f"pass@1[avg-of-{k}]"]
        if name != NO_ANSWER:
            aggregates += [f"pass@{k}", f"majority@{k}"]
        for aggregate in aggregates:
            key = f"{aggregate}/{name}"
            if key in metrics:
                picked[key] = metrics[key]
    return picked


def summary_lines(metrics: Mapping[str, float], *, k: int | None = None) -> list[str]:
    """One line per score name with its :func:`headline` values, e.g.
    ``accuracy: pass@1[avg-of-4] 62.50% (s.e. 4.17), pass@4 87.50%, majority@4 75.00%``.

    ``s.e.``: the standard error of pass@1 across runs, in percentage points, where there is one.
    """
    picked = headline(metrics, k)
    if not picked:
        return ["pass@k: no scored rollouts"]
    by_name: dict[str, list[str]] = {}
    for key, value in picked.items():
        aggregate, name = key.split("/", 1)
        text = f"{aggregate} {value:.2f}%"
        std_err = metrics.get(f"{key}{STD_ERR_SUFFIX}")
        if std_err is not None:
            text += f" (s.e. {std_err:.2f})"
        by_name.setdefault(name, []).append(text)
    width = max(len(name) for name in by_name)
    return [f"{name + ':':<{width + 1}} {', '.join(parts)}" for name, parts in by_name.items()]
