"""``--set rollout.media_by_reference=true``: the same training, a fraction of the Gym request."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from run_helpers import closed, quiet_train, run_config

pytestmark = pytest.mark.integration

G = 4
# toy shaping gives every group reward variance, so the losses compared are not all zero
SMALL = {
    "steps": 2,
    "bridge.prompts_per_step": 1,
    "bridge.group_size": G,
    "rollout.max_tokens": 6,
    "warmup.steps": 0,
    "shaping.kind": "token_rate",
}


def _records(run_dir: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_media_by_reference_trains_the_same_and_sends_each_image_once(tmp_path: Path) -> None:
    runs = {}
    texts = {}
    for on in (False, True):
        cfg = run_config(tmp_path / str(on), {**SMALL, "rollout.media_by_reference": on})
        runs[on], texts[on] = quiet_train(cfg)
    off, on_ = runs[False], runs[True]
    assert on_.rollouts_ok == off.rollouts_ok == 2 * G and on_.rollouts_failed == 0
    # the same rewards, tokens, losses and trained media keys, step by step
    # (a group's G samples are the same set; which rollout drew which follows arrival order)
    assert on_.env_rewards == pytest.approx(off.env_rewards, abs=1e-9)
    assert on_.shaping_rewards == pytest.approx(off.shaping_rewards, abs=1e-9)
    assert any(m.loss != 0 for m in off.steps) and any(m.grad_norm > 0 for m in off.steps)
    assert [m.num_tokens for m in on_.steps] == [m.num_tokens for m in off.steps]
    assert [m.num_loss_tokens for m in on_.steps] == [m.num_loss_tokens for m in off.steps]
    assert [m.loss for m in on_.steps] == pytest.approx([m.loss for m in off.steps], abs=1e-6)
    assert [m.grad_norm for m in on_.steps] == pytest.approx([m.grad_norm for m in off.steps], abs=1e-6)
    assert on_.media_keys == off.media_keys
    assert all(m.mean_ratio == pytest.approx(1.0, abs=1e-4) for m in on_.steps if m.skipped is None)

    # metrics.jsonl: gym_request media logical / physical = G with references, 1 without
    for rec_on, rec_off in zip(_records(tmp_path / "True"), _records(tmp_path / "False"), strict=True):
        req_on = rec_on["payload"]["gym_request"]  # type: ignore[index]
        req_off = rec_off["payload"]["gym_request"]  # type: ignore[index]
        assert req_off["logical_media_bytes"] == req_off["physical_media_bytes"] > 0  # base64 counted now
        assert req_on["logical_media_bytes"] == req_off["logical_media_bytes"]
        assert req_on["logical_media_bytes"] >= 0.9 * G * req_on["physical_media_bytes"] > 0
        assert req_on["serialized_bytes"] < req_off["serialized_bytes"]

    # the media server ran over <run_dir>/media_store and is stopped
    text = texts[True]
    media = re.search(r"media http://127\.0\.0\.1:(\d+)", text)
    assert media is not None, text
    assert closed(int(media.group(1)))
    stored = list((tmp_path / "True" / "media_store").glob("??/*"))
    assert stored and all(p.name == p.name.lower() and len(p.name) == 64 for p in stored)
    assert "media_store" not in [p.name for p in (tmp_path / "False").iterdir()]


def test_media_by_reference_is_reported_off_on_the_native_path(tmp_path: Path) -> None:
    settings = {**SMALL, "steps": 1, "bridge.group_size": 2, "rollout.native": True}
    result, text = quiet_train(run_config(tmp_path, {**settings, "rollout.media_by_reference": True}))
    assert result.rollouts_failed == 0
    assert "media by reference: off on the native path" in text


def test_model_serve_command_carries_the_media_hosts() -> None:
    from gymbridge.run.generator_process import tiny_server_command

    cmd = tiny_server_command(
        seed=0,
        max_model_len=64,
        default_max_tokens=4,
        prompt_seed=None,
        enable_weight_updates=False,
        media_hosts=("127.0.0.1:5001",),
    )
    assert cmd[-2:] == ["--media-host", "127.0.0.1:5001"]
