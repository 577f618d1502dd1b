"""Several environments in one run: ``env.mix`` (gymbridge's own) and ``env.head_url`` (a head server's).

The config's rules (what a mix or a head server excludes, what it needs), the mixed dataset
(weights as ratios in every prefix, deterministic in the seed, every row tagged with its
environment's ``agent_ref``), the start-up check of ``data.path`` rows against the mix, the
native router, and two short real runs of ``color_pick`` + ``side_pick`` (Gym path and native)
whose ``side_pick`` verifier fails one rollout of every group: the records carry per-environment
keys, the failures name their environment, and every group stays within its row's environment.
"""

from __future__ import annotations

import collections
import io
import json
import re
from pathlib import Path
from typing import Any

import orjson
import pytest
from run_helpers import run_config

from gymbridge.bridge.sources import RolloutRecord, RoutedRollouts
from gymbridge.client import agent_ref, env_of_row
from gymbridge.errors import ConfigError
from gymbridge.run import GRPORun, RunConfig, load_run_config
from gymbridge.run.callbacks import Callback, default_callbacks
from gymbridge.run.data import generated_rows, mixed_order
from gymbridge.run.userenv import EnvMix, resolve_mix

TWO = [{"name": "color_pick"}, {"name": "side_pick"}]
HEAD = "http://127.0.0.1:11000"


def mix_config(mix: list[dict[str, Any]], **settings: Any) -> RunConfig:
    return load_run_config([], [("env.mix", mix), *settings.items()])


# ------------------------------------------------------------------------------------- the config
@pytest.mark.parametrize(
    ("env", "settings", "message"),
    [
        ({"head_url": HEAD, "agent_url": "http://a"}, {}, r"env.head_url with env.agent_url"),
        ({"head_url": HEAD, "name": "color_pick"}, {}, r"env.head_url with env.name"),
        ({"head_url": HEAD}, {}, r"env.head_url: give data.path"),
        ({"head_url": HEAD}, {"rollout": {"native": True}}, r"env.head_url: native rollouts"),
        ({"head_url": HEAD}, {"warmup": {"steps": 3}}, r"warmup.steps=3 with env.head_url"),
        ({"mix": TWO, "name": "color_pick"}, {}, r"env.mix with env.name"),
        ({"mix": TWO, "head_url": HEAD}, {}, r"env.mix with env.head_url"),
        ({"mix": TWO, "params": {"img_size": 64}}, {}, r"env.params with env.mix"),
        ({"mix": TWO}, {"warmup": {"steps": 3}}, r"warmup.steps=3 with env.mix"),
        ({"mix": [{"name": "a", "label": "x"}, {"name": "b", "label": "x"}]}, {}, r"labels \['x'\]"),
        ({"mix": [{"name": "color_pick", "weight": 0}]}, {}, r"weight"),
        ({"mix": [{"name": "color_pick", "label": "a/b"}]}, {}, r"label"),
    ],
)
def test_a_mix_or_a_head_server_with_what_it_excludes_is_refused(
    env: dict[str, Any], settings: dict[str, Any], message: str
) -> None:
    data = {"data": {"path": "rows.jsonl"}} if "path" not in message else {}
    with pytest.raises(ConfigError, match=message):
        load_run_config([], [("env", env), *((k, v) for k, v in {**data, **settings}.items())])


def test_labels_default_to_the_names_and_number_a_repeat() -> None:
    cfg = mix_config([*TWO, {"name": "color_pick"}, {"name": "my_pkg.envs:Mine", "label": "mine"}])
    assert cfg.env.mix_labels == ["color_pick", "side_pick", "color_pick-2", "mine"]
    assert cfg.env_label == "mix"
    assert load_run_config([], [], {"head_url": HEAD, "dataset": "r.jsonl"}).env_label == "head"


def test_naming_a_mix_or_a_head_server_switches_away_from_the_overlays_environment() -> None:
    """smoke's color_pick and its 4-token budget and format warm-up give way to the mix / the head."""
    mixed = load_run_config(["smoke"], [("env.mix", TWO)])
    assert mixed.env.name is None and [e.name for e in mixed.env.mix] == ["color_pick", "side_pick"]
    assert mixed.rollout.max_tokens == 256 and mixed.warmup.steps == 0
    assert mixed.trainer.lr == load_run_config(["smoke"]).trainer.lr  # the tiny model's tuning stays
    head = load_run_config(["smoke"], [], {"head_url": HEAD, "dataset": "r.jsonl"})
    assert (head.env.name, head.env.head_url, head.warmup.steps) == (None, HEAD, 0)
    with pytest.raises(ConfigError, match=r"env\.mix with env\.name"):  # two environments named: which?
        load_run_config(["smoke"], [("env.mix", TWO)], {"env": "counter"})
    same = load_run_config(["smoke"], ["env.params.img_size=64"])  # no other environment: no switch
    assert (same.env.name, same.rollout.max_tokens, same.warmup.steps) == ("color_pick", 4, 40)


# ------------------------------------------------------------------------------------ the dataset
def _mix(mix: list[dict[str, Any]]) -> tuple[RunConfig, EnvMix]:
    cfg = mix_config(mix)
    return cfg, resolve_mix(cfg.env)


@pytest.mark.parametrize("weights", [(1, 1), (3, 1), (1, 2.5)])
def test_the_weights_are_the_ratios_in_every_prefix(weights: tuple[float, float]) -> None:
    order = list(mixed_order(list(weights), 200))
    share = weights[0] / sum(weights)
    for n in range(1, len(order) + 1):
        assert abs(order[:n].count(0) - n * share) < 1, n


def test_the_mixed_rows_are_tagged_and_deterministic_in_the_seed() -> None:
    cfg, mix = _mix([{"name": "color_pick", "weight": 3}, {"name": "side_pick"}])
    rows = list(generated_rows(cfg, mix, 40, seed=5))
    assert collections.Counter(env_of_row(r) for r in rows) == {"color_pick": 30, "side_pick": 10}
    assert all(r["agent_ref"] == agent_ref(str(env_of_row(r))) for r in rows)
    assert rows == list(generated_rows(cfg, mix, 40, seed=5))
    other = list(generated_rows(cfg, mix, 40, seed=6))  # validation rows: another seed, other rows
    assert [env_of_row(r) for r in other] == [env_of_row(r) for r in rows]
    for env in ("color_pick", "side_pick"):
        mine = [r for r in rows if env_of_row(r) == env]
        assert [r for r in other if env_of_row(r) == env] != mine
        # each environment contributes the rows its own run at that seed trains on
        from gymbridge_envs import get_env

        assert [{k: v for k, v in r.items() if k != "agent_ref"} for r in mine] == list(
            get_env(env).generate(len(mine), 5)
        )


def test_the_same_environment_twice_gets_rows_of_its_own_and_its_own_params() -> None:
    cfg, mix = _mix([{"name": "color_pick", "params": {"colors": "red,blue"}}, {"name": "color_pick"}])
    rows = list(generated_rows(cfg, mix, 8, seed=0))
    assert [env_of_row(r) for r in rows] == ["color_pick", "color_pick-2"] * 4
    first = [r["responses_create_params"] for r in rows if env_of_row(r) == "color_pick"]
    second = [r["responses_create_params"] for r in rows if env_of_row(r) == "color_pick-2"]
    assert first != second


def test_a_bad_generator_parameter_of_a_mix_names_its_entry(tmp_path: Path) -> None:
    cfg = run_config(
        tmp_path, {"env.mix": [{"name": "color_pick"}, {"name": "side_pick", "params": {"nope": 1}}]}
    )
    with pytest.raises(
        ConfigError, match=r"env.mix\[1\].params: side_pick: unknown generator parameter 'nope'"
    ):
        _set_up_data(cfg)
    assert not (tmp_path / "dataset.jsonl").exists()


def _set_up_data(cfg: RunConfig) -> GRPORun:
    run = GRPORun(cfg, callbacks=[])
    run._setup_run_dir()
    run._setup_data(run._resolve_env())
    return run


def _rows_file(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def _row(i: int, env: str | None) -> dict[str, Any]:
    row: dict[str, Any] = {"responses_create_params": {"input": f"question {i}"}}
    return row if env is None else {**row, "agent_ref": agent_ref(env)}


def test_data_path_rows_must_name_an_environment_of_the_mix(tmp_path: Path) -> None:
    rows = _rows_file(tmp_path / "rows.jsonl", [_row(0, "color_pick"), _row(1, None), _row(2, "zoom_read")])
    cfg = run_config(tmp_path / "run", {"env.mix": TWO, "data.path": str(rows)})
    with pytest.raises(ConfigError) as err:
        _set_up_data(cfg)
    problems = err.value.problems
    assert len(problems) == 2, problems
    assert "line 2: no agent_ref: with env.mix every row names its environment" in problems[0]
    assert "line 3: agent_ref names 'zoom_read', not an environment of env.mix" in problems[1]
    good = _rows_file(tmp_path / "good.jsonl", [_row(0, "side_pick"), _row(1, "color_pick")])
    _set_up_data(run_config(tmp_path / "run2", {"env.mix": TWO, "data.path": str(good)}))
    assert (tmp_path / "run2" / "dataset.ref.json").is_file()


def test_data_path_rows_must_name_their_agent_with_a_head_server(tmp_path: Path) -> None:
    rows = _rows_file(tmp_path / "rows.jsonl", [_row(0, "any_agent"), _row(1, None)])
    cfg = load_run_config([], [], {"head_url": HEAD, "dataset": str(rows), "run_dir": str(tmp_path / "run")})
    with pytest.raises(
        ConfigError, match=r"line 2: no agent_ref: with env.head_url every row names the agent"
    ):
        _set_up_data(cfg)


def test_a_mix_of_a_class_of_your_own_needs_data_path(tmp_path: Path) -> None:
    cfg = run_config(
        tmp_path, {"env.mix": [{"name": "color_pick"}, {"name": "gymbridge.server.examples:CounterEnv"}]}
    )
    with pytest.raises(
        ConfigError, match=r"env.mix: gymbridge.server.examples-CounterEnv .* no data generator"
    ):
        _set_up_data(cfg)


def test_the_model_takes_every_environments_media() -> None:
    _, mix = _mix([{"name": "color_pick"}, {"name": "beep_count"}, {"name": "side_pick"}])
    assert mix.modalities == ("image", "audio") and mix.max_turns == max(e.spec.max_turns for e in mix.envs)


# ------------------------------------------------------------------------------ the native router
class _Echo:
    def __init__(self, name: str) -> None:
        self.name, self.closed = name, False

    async def rollouts(self, row: Any, *, task_index: int, group_size: int) -> list[RolloutRecord]:
        return [RolloutRecord(task_index, i, result={"env": self.name}) for i in range(group_size)]

    async def aclose(self) -> None:
        self.closed = True


async def test_routed_rollouts_send_a_row_to_its_environments_source() -> None:
    a, b = _Echo("a"), _Echo("b")
    routed = RoutedRollouts({"a": a, "b": b})
    got = await routed.rollouts(_row(0, "b"), task_index=7, group_size=3)
    assert [r.result for r in got] == [{"env": "b"}] * 3
    for bad in (_row(1, None), _row(2, "c")):
        lost = await routed.rollouts(bad, task_index=8, group_size=2)
        assert [r.failure_class for r in lost] == ["unroutable"] * 2
        assert "this run's are ['a', 'b']" in str(lost[0].failure_reason)
    await routed.aclose()
    assert a.closed and b.closed


# ------------------------------------------------------------------------------------ a real run
G = 3


class Reports(Callback):
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.groups: list[tuple[int, str | None]] = []

    def on_step(self, report: Any, record: Any) -> None:
        self.records.append(dict(record))
        self.groups += [(g.task_index, g.env) for g in report.batch.groups]


@pytest.fixture
def side_pick_fails_rollout_0(monkeypatch: pytest.MonkeyPatch) -> dict[str, set[tuple[int, int]]]:
    """Both environments' verifiers record the (task, rollout) they verify; side_pick's fails rollout 0."""
    from gymbridge_envs.color_pick.server import ColorPickServer
    from gymbridge_envs.side_pick.server import SidePickServer

    seen: dict[str, set[tuple[int, int]]] = {"color_pick": set(), "side_pick": set()}
    for name, cls in (("color_pick", ColorPickServer), ("side_pick", SidePickServer)):
        original = cls.verify

        async def verify(
            self: Any, session: Any, row: Any, response: Any, *, _n: str = name, _f: Any = original
        ) -> Any:
            index = (int(row["_ng_task_index"]), int(row["_ng_rollout_index"]))
            seen[_n].add(index)
            if _n == "side_pick" and index[1] == 0:
                raise RuntimeError("side_pick's verifier fails rollout 0 (the test's fault)")
            return await _f(self, session, row, response)

        monkeypatch.setattr(cls, "verify", verify)
    return seen


@pytest.mark.integration
@pytest.mark.parametrize("native", [False, True], ids=["gym_path", "native_path"])
def test_a_mixed_run_reports_each_environment_and_keeps_groups_within_one(
    native: bool, tmp_path: Path, side_pick_fails_rollout_0: dict[str, set[tuple[int, int]]]
) -> None:
    from gymbridge.run import train

    settings = {"env.mix": TWO, "steps": 2, "bridge.prompts_per_step": 2, "bridge.group_size": G}
    cfg = run_config(tmp_path, {**settings, "rollout.max_tokens": 4, "rollout.native": native})
    reports, console = Reports(), io.StringIO()
    summary = train(cfg, callbacks=[*default_callbacks(out=console), reports])
    dataset = [json.loads(line) for line in (tmp_path / "dataset.jsonl").read_text().splitlines()]
    assert [env_of_row(r) for r in dataset] == ["color_pick", "side_pick"] * 2

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and records == reports.records
    for r in records:  # each step: one prompt of each environment (weights 1:1)
        assert r["env/color_pick/rollouts_ok"] == G and r["env/color_pick/rollouts_failed"] == 0
        assert r["env/side_pick/rollouts_ok"] == G - 1 and r["env/side_pick/rollouts_failed"] == 1
        assert r["rollouts_ok"] == 2 * G - 1 and r["rollouts_failed"] == 1
        for env in ("color_pick", "side_pick"):
            assert 0.0 <= r[f"env/{env}/reward_mean"] <= 1.0 and r[f"env/{env}/tokens"] > 0
    # a group is one row's rollouts, all run by the row's environment
    assert sorted(reports.groups) == [(i, env_of_row(dataset[i])) for i in range(4)]
    for env, verified in side_pick_fails_rollout_0.items():
        tasks = {t for t, _ in verified}
        assert tasks == {i for i in range(4) if env_of_row(dataset[i]) == env}
        assert verified == {(t, i) for t in tasks for i in range(G)}

    failures = [json.loads(line) for line in (tmp_path / "failures.jsonl").read_text().splitlines()]
    assert failures and all(f["env"] == "side_pick" for f in failures), failures
    assert {(f["task_index"], f["rollout_index"]) for f in failures} == {(1, 0), (3, 0)}

    text = console.getvalue()
    assert "servers: environment color_pick http://127.0.0.1:" in text
    assert "dataset: 4 rows (a mix of color_pick x1, side_pick x1, generated)" in text
    step_lines = [line for line in text.splitlines() if re.match(r"step \d+/2 ", line)]
    assert len(step_lines) == 2 and all(
        "  envs color_pick " in line and "side_pick " in line and "(2 ok / 1 failed)" in line
        for line in step_lines
    ), step_lines
    assert "  env side_pick: reward " in text and f"{2 * (G - 1)} rollouts ok, 2 failed" in text
    assert summary.env_reward_spans.keys() == {"color_pick", "side_pick"}
    assert summary.rollouts_failed == 2
