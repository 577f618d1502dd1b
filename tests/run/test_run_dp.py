"""``gymbridge smoke run --set dp.workers=2``: the run trains through the workers' process group.

One run (its own local Ray, stopped on return) covers what a user sees of DP: the group's backend
and size in ``metrics.jsonl``, token-balanced shards, the bf16 cast of the pixels before the Ray
transfer (half the ``policy_shard`` media bytes of ``rollout_to_policy``; grids stay int64), the
generator receiving every step's weights (the drift guard passes), and a checkpoint holding
rank 0's optimizer state.
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from gymbridge.cli import main
from gymbridge.run import load_run_config

pytestmark = pytest.mark.integration


def test_smoke_dp_trains_through_the_group_with_bf16_media(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    argv = [
        "smoke",
        "run",
        "--steps",
        "2",
        "--prompts",
        "2",
        "--group-size",
        "4",
        "--run-dir",
        str(tmp_path),
        "--no-progress",
    ]
    settings = ("dp.workers=2", "trainer.dtype=bfloat16", "warmup.steps=0", "shaping.kind=token_rate")
    for setting in (*settings, "rollout.max_tokens=16", "checkpoint.every=2"):
        argv += ["--set", setting]
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(argv) == 0
    text = out.getvalue()
    assert "one torch.distributed group (gloo" in text and "policy dtype: bfloat16" in text
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        assert r["dp_backend"] == "gloo" and r["dp_world_size"] == 2 and r["dp_weights_s"] > 0
        assert len(r["dp_shard_tokens"]) == 2 and sum(r["dp_shard_tokens"]) == r["num_tokens"]
        assert r["dp_media_dtypes"] == {"image_grid_thw": "int64", "pixel_values": "bfloat16"}
        sent, built = r["payload"]["policy_shard"], r["payload"]["rollout_to_policy"]
        assert 0.45 < sent["physical_media_bytes"] / built["physical_media_bytes"] < 0.55
        assert r["skipped"] is None and abs(r["ratio_mean"] - 1) < 1e-2  # the generator got v1
        # each worker encoded its shard's image once (whole groups per shard), for every row of it
        assert r["encoder_dedup"] and r["encoder_segments"] == len(r["media_keys"]) == 2
        assert r["encoder_refs"] == r["num_rows"] == 8
    assert [r["policy_version"] for r in records] == [1, 2]
    import torch

    from gymbridge.trainer import GRPOTrainer, load_checkpoint, tiny_policy

    trainer = GRPOTrainer(tiny_policy(0).to(torch.bfloat16), load_run_config(["smoke"]).trainer)
    assert load_checkpoint(tmp_path / "checkpoints", trainer=trainer) is not None
    assert (
        trainer.steps == 2 and trainer.optimizer.state
    )  # rank 0's AdamW moments, not the driver's blank one


def test_bf16_policy_with_a_process_generator_is_a_config_error() -> None:
    """The child model server builds float32: published bf16 weights would not fit it."""
    from gymbridge.errors import ConfigError

    with pytest.raises(ConfigError, match=r"trainer\.dtype=bfloat16 with generator\.placement=process"):
        load_run_config(["smoke"], [("trainer.dtype", "bfloat16"), ("generator.placement", "process")])
    assert load_run_config(["smoke"], [("dp.ray_address", "auto")]).dp.ray_address == "auto"
