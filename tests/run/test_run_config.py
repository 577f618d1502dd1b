"""The run's config: sections, defaults defined once, overlays that state only what differs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from gymbridge.bridge import BridgeConfig
from gymbridge.errors import ConfigError
from gymbridge.run import RunConfig, load_run_config
from gymbridge.run.config import CONFIGS_DIR, ENV_BOUND_KEYS, read_overlay
from gymbridge.trainer import GRPOConfig

SHIPPED = sorted(CONFIGS_DIR.glob("*.yaml"))


def _defaults() -> dict[str, Any]:
    """The defaults as a plain mapping: the config classes' own (``RunConfig()``), nothing else."""
    return RunConfig().model_dump(mode="json")


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict) and data:
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): data}


def test_there_are_shipped_overlays() -> None:
    assert {"smoke.yaml", "smoke_native.yaml", "smoke_ray.yaml"} <= {p.name for p in SHIPPED}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_is_its_overlay_chain_over_the_defaults(path: Path) -> None:
    """A shipped config resolves to exactly: the defaults, each ``defaults:`` parent's keys, its own keys."""
    chain: list[dict[str, Any]] = []
    name: str | None = path.stem
    while name is not None:
        raw = yaml.safe_load((CONFIGS_DIR / f"{name}.yaml").read_text())
        parent = raw.pop("defaults", None)
        chain.insert(0, raw)
        assert parent is None or (isinstance(parent, list) and len(parent) == 1), path
        name = parent[0] if parent else None
    expected = _defaults()
    for layer in chain:
        expected = OmegaConf.to_container(OmegaConf.merge(expected, layer), resolve=True)  # type: ignore[assignment]
    cfg = load_run_config([path.stem])
    got = cfg.model_dump(mode="json")
    # lr_decay_steps follows steps on every path (the one derived default)
    expected["trainer"]["lr_decay_steps"] = expected["steps"]
    assert got == RunConfig.model_validate(expected).model_dump(mode="json")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_no_overlay_restates_a_value_it_overlays(path: Path) -> None:
    """Defaults are defined once: an overlay key whose value equals what it overlays is a second copy."""
    raw = yaml.safe_load(path.read_text())
    parents = raw.pop("defaults", [])
    base = _flatten(_defaults())
    for parent in parents:
        base.update(_flatten(OmegaConf.to_container(read_overlay(parent), resolve=False)))
    restated = {k: v for k, v in _flatten(raw).items() if k in base and base[k] == v}
    assert restated == {}, f"{path.name} restates {restated}"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_validates_against_its_environment(path: Path) -> None:
    cfg = load_run_config([path.stem])
    from gymbridge_envs import get_env

    assert cfg.env.name is not None
    spec = get_env(cfg.env.name)
    spec.check_params(cfg.env.params)
    list(spec.generate(1, cfg.seed, **cfg.env.params))


def test_the_defaults_are_a_real_users_not_the_toys() -> None:
    """Regression: ``gymbridge train --env module:Class`` inherited the colour toy's lr 2e-3, its warm-up
    and adam_eps 1e-5; every bundled env but color_pick trained with lr 2e-2 and digit shaping on."""
    cfg = RunConfig()
    assert cfg.trainer.lr == 1e-6 and cfg.trainer.adam_eps == 1e-8 and not cfg.trainer.lr_scheduled
    assert cfg.warmup.steps == 0 and cfg.shaping.kind == "none"
    assert GRPOConfig().lr == cfg.trainer.lr and BridgeConfig() == cfg.bridge  # one definition each
    for env in ("counter", "circle_click", "zoom_read", "my_pkg.envs:MyEnv"):
        user = load_run_config([], [], {"env": env})
        assert (user.trainer.lr, user.shaping.kind, user.warmup.steps) == (1e-6, "none", 0), env
    toy = load_run_config(["smoke"])
    assert (toy.trainer.lr, toy.trainer.adam_eps, toy.warmup.steps) == (2e-3, 1e-5, 40)


def test_the_lr_decay_follows_steps_on_every_path() -> None:
    """Regression: ``SmokeConfig(steps=2)`` decayed over 100 updates while the YAML path decayed over 2."""
    assert RunConfig(steps=2).trainer.lr_decay_steps == 2
    assert (
        RunConfig.model_validate({"steps": 7, "trainer": {"lr_schedule": "cosine"}}).trainer.lr_decay_steps
        == 7
    )
    assert load_run_config(["smoke"], [], {"steps": 3}).trainer.lr_decay_steps == 3
    assert load_run_config(["smoke"], ["steps=5"]).trainer.lr_decay_steps == 5
    assert load_run_config(["smoke_ray"]).trainer.lr_decay_steps == 3
    assert (
        load_run_config(["smoke"], ["trainer.lr_decay_steps=50"], {"steps": 9}).trainer.lr_decay_steps == 50
    )
    ray = load_run_config(["smoke_ray"])  # regression: smoke_ray.yaml dropped the schedule and adam_eps
    assert (ray.trainer.lr_schedule, ray.trainer.adam_eps) == ("cosine", 1e-5)


def test_switching_the_environment_drops_what_belongs_to_the_overlays() -> None:
    tool = load_run_config(["smoke_color_tool"])
    assert tool.rollout.force_first_call is not None and tool.env.params["reveal"] == "tool"
    other = load_run_config(["smoke_color_tool"], [], {"env": "counter"})
    assert other.env.params == {} and other.rollout.force_first_call is None
    assert other.rollout.max_turns is None and other.warmup.steps == 0
    assert other.trainer.lr == tool.trainer.lr  # the overlay's tuning stays: it is the tiny model's
    assert "env.params" in ENV_BOUND_KEYS
    agent = load_run_config(["smoke"], [], {"agent_url": "http://127.0.0.1:1", "dataset": "rows.jsonl"})
    assert agent.env.name is None and agent.env.agent_url == "http://127.0.0.1:1"


def test_overrides_flags_and_their_order() -> None:
    cfg = load_run_config(["smoke"], ["trainer.lr=1e-3", "env.params.img_size=64", "steps=9"], {"steps": 3})
    assert (cfg.trainer.lr, cfg.env.params["img_size"], cfg.steps) == (1e-3, 64, 3)  # flags come last
    cfg = load_run_config(
        ["smoke"], [], {"group_size": 4, "prompts_per_step": 3, "native": True, "dp_workers": 0}
    )
    assert (cfg.bridge.group_size, cfg.bridge.prompts_per_step, cfg.rollout.native) == (4, 3, True)


def test_a_typo_or_a_bad_value_names_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: 2\ntrainer:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="learning_rate"):
        load_run_config([str(bad)])
    with pytest.raises(ConfigError) as err:
        load_run_config(["smoke"], ["bridge.group_size=0", "trainer.lrr=1", "steps=many"])
    text = str(err.value)
    assert "bridge.group_size" in text and "trainer.lrr" in text and "steps" in text


def test_a_trainer_temperature_below_float32s_range_is_refused_before_the_run_starts() -> None:
    """1e-40 passed validation and the run sampled greedily, then every step raised: the
    policy-gradient step cannot divide logits by it (``GREEDY_BELOW_TEMPERATURE``)."""
    for value in ("1e-40", "1e-300", "0"):
        with pytest.raises(ConfigError, match=r"trainer\.temperature"):
            load_run_config(["smoke"], [f"trainer.temperature={value}"])
    assert load_run_config(["smoke"], ["trainer.temperature=0.7"]).trainer.temperature == 0.7


def test_an_old_flat_key_names_its_new_place() -> None:
    with pytest.raises(ConfigError, match=r"dedup: .* bridge\.dedup") as err:
        load_run_config(["smoke"], ["dedup=false", "max_turns=2"])
    assert any("rollout.max_turns" in p for p in err.value.problems)


def test_defaults_chains_and_cycles(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("defaults: [smoke]\nsteps: 4\n")
    (tmp_path / "b.yaml").write_text("defaults: [a]\nbridge:\n  group_size: 4\n")
    cfg = load_run_config([str(tmp_path / "b.yaml")])
    assert (cfg.steps, cfg.bridge.group_size, cfg.env.name) == (4, 4, "color_pick")
    (tmp_path / "c.yaml").write_text("defaults: [d]\n")
    (tmp_path / "d.yaml").write_text("defaults: [c]\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_run_config([str(tmp_path / "c.yaml")])
    with pytest.raises(ConfigError, match="cannot read"):
        load_run_config(["no_such_config"])


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"rollout.withhold_later_media": True}, "withhold_later_media needs rollout.native"),
        ({"rollout.force_first_call": "<tool_call>"}, "force_first_call needs rollout.native"),
        ({"trainer.dtype": "bfloat16", "generator.placement": "process"}, "in_process"),
        ({"bridge.min_group_size": 9}, "larger than group_size"),
        ({"model.name": "gpt-5"}, "model directory"),
    ],
)
def test_sections_that_disagree_are_refused_before_anything_starts(
    settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_run_config(["smoke"], list(settings.items()))
