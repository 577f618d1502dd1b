"""The run end to end on loopback: numbers printed, every server stopped, errors typed."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from run_helpers import SMALL, closed, ports, quiet_train, run_config

from gymbridge.cli import main
from gymbridge.errors import ConfigError
from gymbridge.run import load_run_config

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("native", [False, True], ids=["gym_path", "native_path"])
def test_a_run_goes_end_to_end_and_stops_its_servers(native: bool, tmp_path: Path) -> None:
    # the toy shaping gives the random model's groups reward variance, so both steps train
    settings = {**SMALL, "bridge.group_size": 4, "rollout.native": native, "shaping.kind": "token_rate"}
    settings["rollout.max_tokens"] = 16
    result, text = quiet_train(run_config(tmp_path, settings))
    assert len(result.steps) == 2 and result.rollouts_ok == 8 and result.rollouts_failed == 0
    assert re.search(
        r"step 2/2  env reward \d\.\d{3}  shaped reward \d\.\d{3}  loss [+-]\d\.\d{5}  tokens \d+", text
    )
    # teacher forcing in the trainer reproduces the generator's logprobs through the whole path
    trained = [m for m in result.steps if m.skipped is None]
    assert trained and all(m.mean_ratio == pytest.approx(1.0, abs=1e-4) for m in trained)
    assert all(m.skipped == "zero_advantage" for m in result.steps if m not in trained)
    assert "rollout_to_policy" in result.payload_table and "4.00x" in result.payload_table
    found = ports(text)
    assert len(found) == (1 if native else 3)
    assert all(closed(p) for p in found)
    assert (tmp_path / "dataset.jsonl").is_file()
    assert [r["step"] for r in result.records] == [1, 2]
    if native:
        assert result.model_media_cache == {}
    else:
        # the model server decoded and processed each prompt's image once for its G rollouts
        processed = result.model_media_cache["kinds"]["processed:image"]
        assert 1 <= processed["misses"] <= 2 and processed["hits"] >= 2 * 8 - processed["misses"]
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
    import io

    from gymbridge.run import train

    out = io.StringIO()
    with pytest.raises(error, match="blew up"):
        train(run_config(tmp_path, SMALL), out=out)
    found = ports(out.getvalue())
    assert len(found) == 3 and all(closed(p) for p in found)


def test_a_bad_generator_parameter_is_a_config_error_before_any_server(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"img_size"):
        quiet_train(run_config(tmp_path, {**SMALL, "env.params.img_size": 10}))
    assert not (tmp_path / "metrics.jsonl").exists()


def test_the_cli_reports_config_errors_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["smoke", "run", "--set", "steps=-1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "steps" in err and "Traceback" not in err
    assert main(["train", "--no-progress", "--steps", "1"]) == 2  # nothing to train on
    assert "--env NAME|module:Class, or --agent-url URL" in capsys.readouterr().err


def test_dp_without_ray_is_a_config_error_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import io

    from gymbridge.run import train

    monkeypatch.setitem(sys.modules, "ray", None)
    out = io.StringIO()
    with pytest.raises(ConfigError, match=r"gymbridge\[ray\]"):
        train(run_config(tmp_path, {**SMALL, "dp.workers": 2}), out=out)
    assert all(closed(p) for p in ports(out.getvalue()))


def test_toy_shaping_is_opt_in_and_makes_the_reward_rise(tmp_path: Path) -> None:
    """``shaping.kind: token_rate`` on circle_click (whose env reward the random model never earns):
    the shaped reward rises within a few steps, the env reward stays 0 and is reported as such."""
    settings = {
        "rollout.native": True,
        "rollout.max_tokens": 16,
        "steps": 6,
        "output.payload_metrics": False,
        "shaping.kind": "token_rate",
        "trainer.lr": 4e-2,
        "trainer.lr_warmup_steps": 0,
        "trainer.lr_schedule": "constant",
    }
    settings["env.params"] = {"img_size": 112, "radius_min": 8, "radius_max": 12}
    settings["output.run_dir"] = str(tmp_path)
    cfg = load_run_config(["smoke"], list(settings.items()), {"env": "circle_click"})
    result, text = quiet_train(cfg)
    m = re.search(r"shaped reward (\d\.\d{3}) -> (\d\.\d{3}) over 6 steps", text)
    assert m, text
    first, last = float(m.group(1)), float(m.group(2))
    assert last >= 2 * first and last - first >= 0.05, text
    assert re.search(r"step 6/6  env reward 0\.000  shaped reward \d\.\d{3}  loss", text), text
    assert all(e == 0.0 for e in result.env_rewards)  # the genuine env reward is kept, not replaced
    assert all(s.grad_norm > 0 for s in result.steps)  # GRPO sees reward variance now
    assert result.rollouts_failed == 0


def test_reruns_with_the_same_seed_match(tmp_path: Path) -> None:
    """Per-rollout sampling seeds from (seed, task, rollout): same seed, same samples and the same
    numbers up to float rounding (the rows share forward passes in whatever batches their arrival
    makes: docs/generation.md, "Sampling seeds"); another seed differs."""
    settings = {**SMALL, "rollout.native": True, "bridge.group_size": 4, "output.payload_metrics": False}
    settings["shaping.kind"] = "token_rate"
    runs = iter(range(100))

    def run(seed: int) -> list[tuple[float, float, float]]:
        cfg = run_config(tmp_path / f"{seed}-{next(runs)}", {**settings, "seed": seed})
        res, _ = quiet_train(cfg)
        return [(m.loss, m.grad_norm, s) for m, s in zip(res.steps, res.shaping_rewards, strict=True)]

    a, b = run(0), run(0)
    assert [s for _, _, s in a] == [s for _, _, s in b]  # the same sampled tokens
    for (loss_a, grad_a, _), (loss_b, grad_b, _) in zip(a, b, strict=True):
        assert (loss_b, grad_b) == pytest.approx((loss_a, grad_a), rel=1e-5, abs=1e-7)
    assert [s for _, _, s in run(1)] != [s for _, _, s in a]


@pytest.mark.parametrize(
    ("env", "modality", "keys"),
    [
        ("beep_count", "audio", "feature_attention_mask, input_features"),
        ("bouncing_ball", "video", "pixel_values_videos, video_grid_thw, video_second_per_grid"),
    ],
)
@pytest.mark.parametrize("native", [False, True], ids=["gym_path", "native_path"])
def test_audio_and_video_envs_train_on_the_omni_model(
    env: str, modality: str, keys: str, native: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``gymbridge smoke run --env beep_count`` / ``bouncing_ball``: the env's small smoke size, the
    Omni thinker picked by modality, every rollout trained (no color_pick setting leaks in)."""
    argv = [
        "smoke",
        "run",
        "--env",
        env,
        "--steps",
        "1",
        "--prompts",
        "1",
        "--group-size",
        "2",
        "--no-progress",
    ]
    argv += ["--run-dir", str(tmp_path), "--set", "rollout.max_tokens=6", "--set", "shaping.kind=token_rate"]
    if native:
        argv.append("--native")
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "model: gymbridge-tiny-qwen2.5-omni-seed0" in text
    assert "format warm-up" not in text  # the colour toy's warm-up belongs to color_pick
    assert "rollouts 2 ok / 0 failed" in text, text
    assert f"media {modality}: {keys} (1 unique)" in text
    import yaml

    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    from gymbridge_envs import get_env

    assert saved["env"]["params"] == get_env(env).smoke_params and saved["env"]["params"]


def test_every_example_env_gets_its_own_generator_parameters() -> None:
    """Regression: ``--env counter`` with the default config failed with ``unknown generator parameter``."""
    from gymbridge.run import load_run_config
    from gymbridge_envs import list_envs

    for spec in list_envs():
        cfg = load_run_config(["smoke"], [("env.params", spec.smoke_params)], {"env": spec.name})
        spec.check_params(cfg.env.params)
        assert cfg.shaping.kind == "none" and cfg.env.params == spec.smoke_params, spec.name
        assert spec.max_turns >= 1


def test_native_rollouts_of_a_tool_env_whose_rows_offer_no_tools_do_not_reset(tmp_path: Path) -> None:
    """Regression: native rollouts guessed gymnasium style from a row without ``tools`` and POSTed
    ``/reset`` to color_pick (a tool-style env), so every rollout failed with HTTP 404."""
    result, _ = quiet_train(run_config(tmp_path, {**SMALL, "rollout.native": True, "rollout.max_tokens": 4}))
    assert result.rollouts_failed == 0 and result.rollouts_ok == 4


def test_every_step_says_where_its_time_went(tmp_path: Path) -> None:
    """Issue 29: each metrics.jsonl line splits ``step_s`` into ``timing/*`` phases (``other`` the
    rest: never negative, so no phase is counted twice), each phase measured where it happens, the
    model server's and the agent's own counters among them; ``charts/timing.png`` draws the split and
    the console's summary gives the medians."""
    import orjson
    from PIL import Image

    from gymbridge.run.timing import PHASES

    settings = {**SMALL, "bridge.group_size": 4, "shaping.kind": "token_rate", "rollout.max_tokens": 16}
    _, text = quiet_train(run_config(tmp_path, settings))
    lines = [orjson.loads(x) for x in (tmp_path / "metrics.jsonl").read_bytes().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    for r in lines:
        timing = {k: v for k, v in r.items() if k.startswith("timing/")}
        assert set(timing) == {f"timing/{p}" for p in PHASES}
        assert all(v >= 0 for v in timing.values())  # ``other`` too: the phases do not overlap
        # the update's phases are the trainer's own measures; the publication is inside weight_sync
        assert r["timing/forward_backward"] == pytest.approx(r["forward_backward_s"])
        assert r["timing/optimizer"] == pytest.approx(r["optimizer_s"])
        assert r["timing/weight_sync"] >= r["weight_sync_s"]
        # the Gym path: the model server's compute and the agent's env calls are counted
        assert r["timing/generation"] > 0 and r["timing/env_seed"] > 0 and r["timing/env_verify"] > 0
        assert r["timing/postprocess"] > 0 and r["timing/batch_build"] > 0
        if r["skipped"] is None:
            assert r["timing/forward_backward"] > 0 and r["timing/optimizer"] > 0
            assert r["timing/weight_sync"] > 0
    assert lines[1]["timing/artifacts"] > 0  # step 1's line, console and artifacts hand-off
    with Image.open(tmp_path / "charts" / "timing.png") as img:
        assert img.format == "PNG" and img.size[0] > 100
    assert re.search(r"step time, median of 2 step\(s\): \d+\.\d{3}s; per phase \(s\): wait_rollouts", text)
