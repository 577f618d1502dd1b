"""The one-command launcher: everything on loopback, numbers printed, every server stopped."""

from __future__ import annotations

import io
import re
import socket
from pathlib import Path

import pytest

from gymbridge.cli import load_example_environments
from gymbridge.errors import ConfigError
from gymbridge.launch import smoke
from gymbridge.launch.smoke import SmokeConfig, build_config, run_smoke

pytestmark = pytest.mark.integration

SMALL = {"steps": 2, "prompts_per_step": 1, "group_size": 2, "max_tokens": 6, "max_turns": 1}


def _ports(text: str) -> list[int]:
    line = next(line for line in text.splitlines() if line.startswith("servers:"))
    return [int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", line)]


def _closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.parametrize("native", [False, True], ids=["gym_path", "native_path"])
def test_smoke_runs_end_to_end_and_stops_its_servers(native: bool, tmp_path: Path) -> None:
    out = io.StringIO()
    cfg = SmokeConfig(**SMALL, native=native, run_dir=str(tmp_path))
    result = run_smoke(cfg, out=out)
    text = out.getvalue()
    assert len(result.steps) == 2 and result.rollouts_ok == 4 and result.rollouts_failed == 0
    assert re.search(r"step 2/2  env reward \d\.\d{3}  loss [+-]\d\.\d{5}  tokens \d+", text), text
    assert "shaped reward" not in text  # SmokeConfig's own default: no shaping
    # teacher forcing in the trainer reproduces the generator's logprobs through the whole path
    assert all(m.mean_ratio == pytest.approx(1.0, abs=1e-4) for m in result.steps)
    assert all(m.num_loss_tokens > 0 for m in result.steps)
    assert "rollout_to_policy" in result.payload_table and "2.00x" in result.payload_table
    ports = _ports(text)
    assert len(ports) == (1 if native else 3)
    assert all(_closed(p) for p in ports)
    assert (tmp_path / "dataset.jsonl").is_file()
    if native:
        assert result.model_media_cache == {}
    else:
        # the model server decoded and processed each prompt's image once for its G rollouts
        # (the template's placeholders and the forward share it): 4 requests, 2 prompts
        processed = result.model_media_cache["kinds"]["processed:image"]
        assert 1 <= processed["misses"] <= 2 and processed["hits"] >= 2 * 4 - processed["misses"]
        assert result.model_media_cache["kinds"]["decoded:image"]["misses"] == processed["misses"]
        assert "model server media cache (once per content key): " in text


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt], ids=["error", "ctrl_c"])
def test_an_error_or_ctrl_c_mid_run_still_stops_every_server(
    error: type[BaseException], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def explode(self: object, batch: object) -> object:
        raise error("trainer blew up")

    from gymbridge.trainer import grpo

    monkeypatch.setattr(grpo.GRPOTrainer, "step", explode)
    out = io.StringIO()
    with pytest.raises(error, match="blew up"):
        run_smoke(SmokeConfig(**SMALL, run_dir=str(tmp_path)), out=out)
    ports = _ports(out.getvalue())
    assert len(ports) == 3 and all(_closed(p) for p in ports)


def test_cli_overrides_and_bad_values(tmp_path: Path) -> None:
    cfg = build_config(None, ["trainer.lr=0.5", "env_params.img_size=140"], {"steps": 7, "native": None})
    assert cfg.steps == 7 and cfg.trainer.lr == 0.5 and cfg.env_params["img_size"] == 140
    assert cfg.group_size == 8  # from gymbridge/configs/smoke.yaml
    assert cfg.env == "color_pick" and cfg.shaping.kind == "none"  # the env reward alone, by default
    assert cfg.warmup.steps > 0
    assert build_config(None, [], {"seed": 5}).seed == 5
    with pytest.raises(ConfigError) as err:
        build_config(None, ["group_size=0", ("bogus", 1)], {})
    assert any("group_size" in p for p in err.value.problems) and any(
        "bogus" in p for p in err.value.problems
    )
    with pytest.raises(ConfigError, match="env_params"):
        run_smoke(SmokeConfig(env_params={"img_size": 10}, run_dir=str(tmp_path)), out=io.StringIO())


def test_module_entry_point_reports_config_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert smoke.main(["--set", "steps=-1", "--no-progress"]) == 2
    assert "steps" in capsys.readouterr().err


def test_dp_without_ray_is_a_config_error_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)
    out = io.StringIO()
    with pytest.raises(ConfigError, match=r"gymbridge\[ray\]"):
        run_smoke(SmokeConfig(**SMALL, dp_workers=2, run_dir=str(tmp_path)), out=out)
    assert all(_closed(p) for p in _ports(out.getvalue()))


# ------------------------------------------------------------------ the loop visibly learns
# circle_click's launcher defaults (toy shaping on), shortened: native path, 5 steps, one turn.
# 6 steps: with the one-token colour words in the tiny tokenizer (new token ids, so new random
# embeddings) this seeded run's shaped reward is 0.031, 0.020, 0.004, 0.055, 0.070, 0.258
FAST_LEARN = {"env": "circle_click", "native": True, "steps": 6, "payload_metrics": False}


def _summary(text: str) -> tuple[float, float]:
    m = re.search(r"shaped reward (\d\.\d{3}) -> (\d\.\d{3}) over (\d+) steps", text)
    assert m, text
    return float(m.group(1)), float(m.group(2))


def test_shaped_reward_rises_fast_variant(tmp_path: Path) -> None:
    """``--env circle_click``'s toy shaping, shortened: the shaped reward clearly rises (seeded)."""
    cfg = build_config(
        None, [("trainer.lr", 4e-2), ("max_turns", 1)], {**FAST_LEARN, "run_dir": str(tmp_path)}
    )
    out = io.StringIO()
    result = run_smoke(cfg, out=out)
    text = out.getvalue()
    first, last = _summary(text)
    assert (first, last) == (round(result.shaping_rewards[0], 3), round(result.shaping_rewards[-1], 3))
    assert last >= 2 * first and last - first >= 0.05, text
    assert re.search(r"step 6/6  env reward 0\.000  shaped reward \d\.\d{3}  loss", text), text
    assert all(e == 0.0 for e in result.env_rewards)  # the genuine env reward is kept, not replaced
    assert all(m.grad_norm > 0 for m in result.steps)  # GRPO sees reward variance now
    assert all(m.mean_ratio == pytest.approx(1.0, abs=1e-4) for m in result.steps)
    assert result.rollouts_failed == 0  # no GeneratedPlaceholderToken failures any more


def test_reruns_with_the_same_seed_match(tmp_path: Path) -> None:
    """Per-rollout sampling seeds from (seed, task, rollout): same seed, same numbers; another differs."""
    small = {**SMALL, "native": True, "group_size": 4, "payload_metrics": False}
    small["shaping"] = {"kind": "token_rate"}

    runs = iter(range(100))

    def run(seed: int) -> list[tuple[float, float, float]]:
        res = run_smoke(
            SmokeConfig(**small, seed=seed, run_dir=str(tmp_path / f"{seed}-{next(runs)}")), out=io.StringIO()
        )
        return [(m.loss, m.grad_norm, s) for m, s in zip(res.steps, res.shaping_rewards, strict=True)]

    a, b = run(0), run(0)
    assert a == b
    assert run(1) != a


@pytest.mark.parametrize(
    ("env", "modality", "keys"),
    [
        ("beep_count", "audio", "feature_attention_mask, input_features"),
        ("bouncing_ball", "video", "pixel_values_videos, video_grid_thw, video_second_per_grid"),
    ],
)
@pytest.mark.parametrize("native", [False, True], ids=["gym_path", "native_path"])
def test_smoke_trains_audio_and_video_envs_on_the_omni_model(
    env: str, modality: str, keys: str, native: bool, tmp_path: Path
) -> None:
    """``--env beep_count`` / ``--env bouncing_ball`` used to fail every rollout ("only image media")."""
    out = io.StringIO()
    cfg = build_config(
        None, [], {"env": env, "native": native, "work_dir": str(tmp_path), **SMALL, "steps": 1}
    )
    # the default config's color_pick parameters do not leak into another env: it gets its own defaults
    assert cfg.env_params == load_example_environments().get_env(env).launcher_defaults().get(
        "env_params", {}
    )
    result = run_smoke(cfg, out=out)
    text = out.getvalue()
    assert "model: gymbridge-tiny-qwen2.5-omni-seed0" in text
    assert result.rollouts_ok == 2 and result.rollouts_failed == 0, text
    assert result.steps[0].num_loss_tokens > 0
    assert result.steps[0].mean_ratio == pytest.approx(1.0, abs=1e-4)
    assert f"media {modality}: {keys} (1 unique)" in text
    assert result.media_keys == [{modality: keys.split(", ")}]


def test_smoke_model_key_overrides_the_modality_choice() -> None:
    assert build_config(None, [("model", "tiny-qwen2.5-omni")], {}).model == "tiny-qwen2.5-omni"
    with pytest.raises(ConfigError, match="model"):
        build_config(None, [("model", "gpt-5")], {})


def test_env_flag_gets_the_environments_own_default_params() -> None:
    """Regression: ``--env counter`` with the default config failed with ``unknown generator parameter``."""
    from gymbridge_envs import get_env, list_envs

    for spec in list_envs():
        cfg = build_config(None, [], {"env": spec.name})
        spec.check_params(cfg.env_params)
        assert cfg.env_params == spec.launcher_defaults().get("env_params", {}), spec.name
    assert build_config(None, [], {"env": "counter"}).shaping.kind == "token_rate"  # its own defaults
    assert build_config(None, [], {"env": "counter"}).warmup.steps == 0
    assert get_env("color_pick").launcher_defaults()["shaping"] == {"kind": "none"}


def test_native_rollouts_of_a_tool_env_whose_rows_offer_no_tools_do_not_reset(tmp_path: Path) -> None:
    """Regression: native rollouts guessed gymnasium style from a row without ``tools`` and POSTed
    ``/reset`` to color_pick (a tool-style env), so every rollout failed with HTTP 404."""
    cfg = SmokeConfig(env="color_pick", native=True, **{**SMALL, "max_tokens": 4}, run_dir=str(tmp_path))
    result = run_smoke(cfg, out=io.StringIO())
    assert result.rollouts_failed == 0 and result.rollouts_ok == 4
