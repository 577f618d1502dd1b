"""Config rules that once let a run do something else than it said: one test per bug."""

from __future__ import annotations

from pathlib import Path

import pytest

from gymbridge.errors import ConfigError, PolicyDriftError
from gymbridge.run import RunConfig, load_run_config
from gymbridge.run.config import RolloutConfig

BUDGET = RolloutConfig.model_fields["max_tokens"].default


@pytest.mark.parametrize("env", ["circle_click", "zoom_read", "counter", "grid_door", "side_pick"])
def test_regression_another_env_does_not_inherit_the_colour_toys_token_budget(env: str) -> None:
    """``smoke.yaml``'s ``rollout.max_tokens: 4`` (one colour word) reached ``--env circle_click``
    etc.: every tool call (about 30 tokens) was cut, every reward was 0, every step skipped."""
    assert load_run_config(["smoke"]).rollout.max_tokens == 4  # the colour toy keeps its own
    switched = load_run_config(["smoke"], [], {"env": env})
    assert switched.rollout.max_tokens == BUDGET
    agent = load_run_config(["smoke"], [], {"agent_url": "http://127.0.0.1:1", "dataset": "rows.jsonl"})
    assert agent.rollout.max_tokens == BUDGET
    given = load_run_config(["smoke"], ["rollout.max_tokens=48"], {"env": env})
    assert given.rollout.max_tokens == 48  # a --set after the switch still counts


def test_regression_warmup_steps_with_an_agent_url_is_refused() -> None:
    """With ``--agent-url`` the run has no environment to warm up on: the warm-up was skipped while
    the trainer line printed "warm-up 40 step(s)"."""
    with pytest.raises(ConfigError, match=r"warmup.steps=40 with env.agent_url"):
        load_run_config([], ["warmup.steps=40"], {"agent_url": "http://127.0.0.1:1", "dataset": "rows.jsonl"})
    # the smoke overlay's warm-up belongs to its environment: the switch drops it
    assert (
        load_run_config(["smoke"], [], {"agent_url": "http://127.0.0.1:1", "dataset": "r.jsonl"}).warmup.steps
        == 0
    )


def test_regression_bf16_with_the_vllm_model_server_is_not_refused(tmp_path: Path) -> None:
    """bf16 was refused with any separate generator ("the model server builds in float32"), but the
    vLLM engine builds in the checkpoint's dtype and casts what the weight sync sends."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    base = {"model": {"name": str(model_dir)}, "trainer": {"dtype": "bfloat16"}}
    vllm = RunConfig.model_validate(
        {**base, "model": {**base["model"], "backend": "vllm"}, "generator": {"placement": "process"}}
    )
    assert vllm.trainer.dtype == "bfloat16"
    with pytest.raises(ValueError, match=r"model.backend=hf: that model server builds .* float32"):
        RunConfig.model_validate({**base, "generator": {"placement": "process"}})
    assert RunConfig.model_validate(base).generator.placement == "in_process"


def test_regression_the_drift_error_names_the_staleness_key_the_config_takes() -> None:
    """It said ``rollout.max_staleness``, a key the config refuses; the key is ``bridge.max_staleness``."""
    text = str(PolicyDriftError(ratio_mean=1.02, ratio_max_abs_log=0.1, tolerance=0.01, step=2))
    assert "bridge.max_staleness 0" in text and "rollout.max_staleness" not in text
    assert load_run_config([], ["bridge.max_staleness=0"]).bridge.max_staleness == 0
