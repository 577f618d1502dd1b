"""The launcher with its generator in another process: on-policy at every step, the child always stopped.

``gymbridge smoke run --set generator.placement=process`` starts ``gymbridge model serve`` as a
child, publishes the trainer's weights to it after every step over torch.distributed (gloo),
and the trainer's drift guard sees ratio 1; a generator left at the step-0 weights fails it.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pytest

from gymbridge.errors import ConfigError, PolicyDriftError
from gymbridge.launch import smoke
from gymbridge.launch.smoke import build_config, run_smoke

pytestmark = pytest.mark.integration

SMALL = {"steps": 3, "prompts_per_step": 2, "group_size": 3, "max_tokens": 8, "max_turns": 1}


def child_is_gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_cli_placement_process_trains_on_policy_at_every_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The done-when of the issue: the CLI line, ratio_mean within 1e-3 of 1 at every step."""
    args = ["--no-progress", "--set", "generator.placement=process", "--work-dir", str(tmp_path)]
    for key, value in SMALL.items():
        args += ["--set", f"{key}={value}"]
    results: list[Any] = []
    real = smoke.run_smoke

    def keep(*a: Any, **k: Any) -> Any:
        results.append(real(*a, **k))
        return results[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(smoke, "run_smoke", keep)
        assert smoke.main(args) == 0
    text = capsys.readouterr().out
    (result,) = results
    assert len(result.steps) == 3 and result.rollouts_failed == 0
    assert all(abs(m.ratio_mean - 1.0) < 1e-3 for m in result.steps), [m.ratio_mean for m in result.steps]
    assert [m.policy_version for m in result.steps] == [1, 2, 3]
    assert all(m.weight_sync_s > 0 for m in result.steps)
    assert "torch.distributed broadcast" in text and "-> v3 (sync " in text
    assert result.model_server_pid is not None and child_is_gone(result.model_server_pid)
    assert (tmp_path / "model_server.log").read_text()  # the child's own log, kept with the run


def test_a_generator_left_at_the_step0_weights_fails_the_drift_guard(tmp_path: Path) -> None:
    """In process with a frozen copy (publication off): the guard fires by step 3, loudly."""
    cfg = build_config(
        None,
        [("generator.publish_weights", False), ("steps", 4), ("work_dir", str(tmp_path))],
        {"env": "circle_click"},  # its toy shaping: the trainer's weights move from step 1 on
    )
    out = io.StringIO()
    with pytest.raises(PolicyDriftError, match="the generator's weights are not the trainer's") as info:
        run_smoke(cfg, out=out)
    assert 2 <= info.value.step <= 3, out.getvalue()
    assert "weight publication OFF" in out.getvalue()


def test_no_child_survives_an_exception(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from gymbridge.launch import generator_process, placement

    pids: list[int] = []
    real = generator_process.start_model_server_process

    def recording(*a: Any, **k: Any) -> generator_process.ModelServerProcess:
        child = real(*a, **k)
        pids.append(child.pid)
        return child

    def explode(self: object, model: object, version: int) -> float:
        raise RuntimeError("publisher blew up")

    monkeypatch.setattr(generator_process, "start_model_server_process", recording)
    monkeypatch.setattr(placement.GeneratorHandle, "publish", explode)
    cfg = build_config(None, [("generator.placement", "process"), ("work_dir", str(tmp_path))], SMALL)
    with pytest.raises(RuntimeError, match="publisher blew up"):
        run_smoke(cfg, out=io.StringIO())
    (pid,) = pids
    assert child_is_gone(pid)


def test_placement_process_needs_the_gym_path(tmp_path: Path) -> None:
    cfg = build_config(
        None, [("generator.placement", "process"), ("native", True), ("work_dir", str(tmp_path))], SMALL
    )
    with pytest.raises(ConfigError, match="Gym path"):
        run_smoke(cfg, out=io.StringIO())


def test_unknown_placement_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="placement"):
        build_config(None, [("generator.placement", "elsewhere")], {})
