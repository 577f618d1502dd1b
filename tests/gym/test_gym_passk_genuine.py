"""gymbridge's pass@k against genuine NeMo Gym 0.7.0: the same grouped results, the same numbers.

Every case is fed to :func:`gymbridge.metrics.pass_majority_metrics` here and to the genuine
``nemo_gym.reward_profile.compute_pass_majority_metrics`` in ``.venv-gym`` (one subprocess, JSON in
and out); the key sets must be equal and every value within 1e-9. The genuine dict's
``per_sample_aggregate`` (per-run pass@1 lists, not a metric) is the one key ours leaves out.
Cases: random binary and continuous rewards, bools, uneven groups (empty, single-rollout), majority
with answers drawn from a tiny alphabet (ties) and some ``None``, a two-score ``score_fn`` that
leaves a score out of some rollouts, and empty input.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
from typing import Any

from _genuine import GYM_PYTHON

from gymbridge.metrics import pass_majority_metrics

# A score_fn both sides build from the case: score name -> result field, missing fields omitted.
_GENUINE = """
import json, sys
from nemo_gym.reward_profile import compute_pass_majority_metrics

def score_fn_of(fields):
    if fields is None:
        return None
    return lambda r: {name: r[field] for name, field in fields.items() if field in r}

out = []
for case in json.load(sys.stdin):
    metrics = compute_pass_majority_metrics(
        case["tasks"], score_fn=score_fn_of(case["fields"]), answer_key=case["answer_key"]
    )[0]
    out.append(metrics)
json.dump(out, sys.stdout)
"""


def genuine_pass_majority_metrics(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Genuine ``compute_pass_majority_metrics(...)[0]`` of each ``{tasks, fields, answer_key}``."""
    proc = subprocess.run(
        [str(GYM_PYTHON), "-c", _GENUINE],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: list[dict[str, Any]] = json.loads(proc.stdout)
    return result


def ours(case: dict[str, Any]) -> dict[str, float]:
    fields = case["fields"]
    score_fn = None
    if fields is not None:

        def score_fn(r: Any) -> dict[str, Any]:
            return {name: r[field] for name, field in fields.items() if field in r}

    return pass_majority_metrics(case["tasks"], score_fn=score_fn, answer_key=case["answer_key"])


def _case(
    rng: random.Random,
    *,
    sizes: list[int],
    reward: str,
    answer_key: str | None = None,
    fields: dict[str, str] | None = None,
) -> dict[str, Any]:
    def one() -> dict[str, Any]:
        if reward == "binary":
            value: Any = rng.choice([0, 1, 1.0, 0.0])
        elif reward == "bool":
            value = rng.random() < 0.4
        elif reward == "continuous":
            value = round(rng.random(), 3)
        else:  # mixed: some tasks end up binary, some continuous
            value = rng.choice([0, 1, 0.5, 0.25])
        result: dict[str, Any] = {"reward": value}
        if answer_key is not None:
            result[answer_key] = rng.choice(["a", "b", "c", None])
        if fields is not None and rng.random() < 0.7:
            result["strict"] = rng.choice([0, 1])
        return result

    return {"tasks": [[one() for _ in range(n)] for n in sizes], "fields": fields, "answer_key": answer_key}


def _cases() -> list[dict[str, Any]]:
    rng = random.Random(20260)
    cases = []
    for reward in ("binary", "bool", "continuous", "mixed"):
        cases.append(_case(rng, sizes=[4] * 12, reward=reward))
        cases.append(_case(rng, sizes=[rng.randint(0, 6) for _ in range(15)], reward=reward))
        cases.append(_case(rng, sizes=[5] * 10, reward=reward, answer_key="answer"))
        cases.append(
            _case(rng, sizes=[rng.randint(0, 5) for _ in range(12)], reward=reward, answer_key="ans")
        )
    two_scores = {"accuracy": "reward", "strict": "strict"}
    cases.append(_case(rng, sizes=[3] * 8, reward="binary", fields=two_scores))
    cases.append(
        _case(
            rng,
            sizes=[rng.randint(1, 6) for _ in range(10)],
            reward="mixed",
            answer_key="a",
            fields=two_scores,
        )
    )
    # ties on purpose: two answers, two rollouts each, within every task
    cases.append(
        {
            "tasks": [
                [{"reward": r, "answer": a} for r, a in ((1, "x"), (0, "y"), (1, "x"), (0, "y"))],
                [{"reward": r, "answer": a} for r, a in ((1, "x"), (0, "x"), (0, "y"), (1, None))],
                [{"reward": 0, "answer": None}] * 4,
            ],
            "fields": None,
            "answer_key": "answer",
        }
    )
    cases.append({"tasks": [], "fields": None, "answer_key": None})
    cases.append({"tasks": [[], []], "fields": None, "answer_key": "answer"})
    cases.append({"tasks": [[{"reward": 1}]], "fields": None, "answer_key": None})
    return cases


def test_pass_majority_metrics_equal_genuine_key_for_key() -> None:
    cases = _cases()
    genuine = genuine_pass_majority_metrics(cases)
    assert len(genuine) == len(cases)
    for i, (case, theirs) in enumerate(zip(cases, genuine, strict=True)):
        theirs = {k: v for k, v in theirs.items() if k != "per_sample_aggregate"}
        mine = ours(case)
        assert set(mine) == set(theirs), (i, sorted(set(mine) ^ set(theirs)))
        wrong = {
            k: (mine[k], theirs[k])
            for k in theirs
            if not math.isclose(mine[k], theirs[k], rel_tol=0, abs_tol=1e-9)
        }
        assert not wrong, (i, wrong)
    assert sum(len(m) for m in genuine) > 500  # the comparison covered many keys
