"""Every config shipped in gymbridge/configs/ loads and validates (unknown keys and bad values are errors)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gymbridge.config import load_config
from gymbridge.errors import ConfigError
from gymbridge.launch.smoke import CONFIGS_DIR, DEFAULT_CONFIG, SmokeConfig, build_config

CONFIGS = sorted(CONFIGS_DIR.glob("*.yaml"))


def test_there_are_configs() -> None:
    assert any(p.name == "smoke.yaml" for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_validates(path: Path) -> None:
    cfg = load_config(path, SmokeConfig)
    assert cfg.steps >= 1 and cfg.group_size >= 1
    if cfg.min_group_size is not None:
        assert cfg.min_group_size <= cfg.group_size
    from gymbridge_envs import get_env

    spec = get_env(cfg.env)
    spec.check_params(cfg.env_params)  # every generator parameter exists
    list(spec.generate(1, cfg.seed, **cfg.env_params))  # and the generator accepts the values


def test_a_typo_is_an_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: 2\ntrainer:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="learning_rate"):
        load_config(bad, SmokeConfig)


def test_the_config_classes_defaults_are_the_shipped_default_config() -> None:
    """One source of defaults: ``SmokeConfig()`` is what ``gymbridge/configs/smoke.yaml`` says."""
    shipped = load_config(DEFAULT_CONFIG, SmokeConfig)
    assert SmokeConfig().model_dump() == shipped.model_dump()


def test_a_run_given_nothing_uses_the_shipped_yaml() -> None:
    assert DEFAULT_CONFIG.is_file() and DEFAULT_CONFIG.parent.parent.name == "gymbridge"
    assert build_config(None, [], {}) == load_config(DEFAULT_CONFIG, SmokeConfig)


def test_a_shipped_config_by_name() -> None:
    by_name = build_config("smoke_ray", [], {})
    assert (
        by_name
        == build_config("smoke_ray.yaml", [], {})
        == load_config(CONFIGS_DIR / "smoke_ray.yaml", SmokeConfig)
    )
    assert by_name.dp_workers > 0
    assert build_config("configs/smoke_ray.yaml", [], {}) == by_name  # the path before they moved
    with pytest.raises(ConfigError, match="cannot read"):
        build_config("configs/no_such_config.yaml", [], {})


def test_set_overrides_merge_through_omegaconf() -> None:
    cfg = build_config(None, ["trainer.lr=1e-3", "warmup.steps=0", "env_params.img_size=64"], {"steps": 3})
    assert (cfg.trainer.lr, cfg.warmup.steps, cfg.env_params["img_size"], cfg.steps) == (1e-3, 0, 64, 3)
    assert cfg.env_params["colors"] == "red,blue"  # a nested override keeps the section's other keys


def test_a_bad_set_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.lrr"):
        build_config(None, ["trainer.lrr=1"], {})
    with pytest.raises(ConfigError, match=r"steps: .*integer"):
        build_config(None, ["steps=many"], {})


def test_withhold_later_media_needs_the_native_path() -> None:
    """The stale-prompt control edits the native generator's input; on the Gym path it is refused."""
    from gymbridge.launch.smoke import build_config

    with pytest.raises(ConfigError, match="withhold_later_media needs native: true"):
        build_config(None, [("withhold_later_media", True)], {"native": False})
    assert build_config(None, [("withhold_later_media", True)], {"native": True}).withhold_later_media


def test_force_first_call_needs_the_native_path() -> None:
    from gymbridge.launch.smoke import build_config

    with pytest.raises(ConfigError, match="force_first_call needs native: true"):
        build_config(None, [("force_first_call", "<tool_call>")], {"native": False})
