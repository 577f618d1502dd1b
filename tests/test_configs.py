"""Every launcher config in configs/ loads and validates (unknown keys and bad values are errors)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gymbridge.config import load_config
from gymbridge.errors import ConfigError
from gymbridge.trainer.smoke import SmokeConfig

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


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
    """One source of defaults: ``SmokeConfig()`` is what ``configs/smoke.yaml`` says."""
    from gymbridge.trainer.smoke import DEFAULT_CONFIG

    shipped = load_config(DEFAULT_CONFIG, SmokeConfig)
    assert SmokeConfig().model_dump() == shipped.model_dump()


def test_withhold_later_media_needs_the_native_path() -> None:
    """The stale-prompt control edits the native generator's input; on the Gym path it is refused."""
    from gymbridge.trainer.smoke import build_config

    with pytest.raises(ConfigError, match="withhold_later_media needs native: true"):
        build_config(None, [("withhold_later_media", True)], {"native": False})
    assert build_config(None, [("withhold_later_media", True)], {"native": True}).withhold_later_media


def test_force_first_call_needs_the_native_path() -> None:
    from gymbridge.trainer.smoke import build_config

    with pytest.raises(ConfigError, match="force_first_call needs native: true"):
        build_config(None, [("force_first_call", "<tool_call>")], {"native": False})
