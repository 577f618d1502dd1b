"""``dp.strategy: fsdp``: FSDP2-sharded Ray DP workers train the step a single process trains.

One module-scoped local Ray (2 CPUs) and two DP trainers over it (tiny Qwen2-VL, 2 workers each:
``fsdp`` and ``replicate``, no CPUs reserved) serve the parity, bytes and failure tests; each test
starts them from the seed-0 weights and fresh optimizers (``sync_workers``). The run-level test
starts its own Ray through ``gymbridge smoke run``.
"""

from __future__ import annotations

import functools
import io
import json
from collections.abc import Iterator
from contextlib import redirect_stdout
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from omni_helpers import png_bytes, wav_bytes
from trainer_helpers import make_batch, media_batch, with_current_logprobs

from gymbridge.errors import TrainingError
from gymbridge.media import MediaItem
from gymbridge.models.tiny_omni import TinyOmni
from gymbridge.models.tiny_vlm import TinyVLM, build_tiny_vlm
from gymbridge.tensors import TrainBatch
from gymbridge.trainer import (
    GRPOConfig,
    GRPOTrainer,
    RayDPTrainer,
    from_config,
    tiny_policy,
)
from gymbridge.trainer.memory import prepare_policy
from gymbridge.trainer.models import tiny_omni_policy
from gymbridge.trainer.ray_dp import lockstep_plan
from gymbridge.trainer.sharding import no_split_classes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

CONFIG = GRPOConfig(lr=1e-3, micro_batch_max_tokens=40, encoder_dedup=False)


def fresh(config: GRPOConfig = CONFIG) -> GRPOTrainer:
    return GRPOTrainer(tiny_policy(0), config, on_policy=False)


def reset(dp: RayDPTrainer) -> RayDPTrainer:
    dp.trainer = fresh(dp.trainer.config)
    dp.sync_workers()
    return dp


def test_lockstep_plan_gives_every_rank_the_same_passes() -> None:
    img, text = ("image",), ()
    ranks = [[(img, True), (img, True), (text, True)], [(img, True), (img, False)]]
    plans = [lockstep_plan(ranks, r) for r in (0, 1)]
    # text passes first (sorted signatures), then image; the short rank repeats with weight 0
    assert plans[0] == [(2, True, False), (0, True, False), (1, True, False)]
    assert plans[1] == [(0, False, True), (0, True, False), (0, False, False)]  # text: media stripped
    shape = [[ranks[r][i][0] if not strip else text for i, _, strip in plans[r]] for r in (0, 1)]
    assert shape[0] == shape[1]
    with pytest.raises(TrainingError, match=r"rank 1's shard has no micro-batch with media \['image'\]"):
        lockstep_plan([[(img, True)], [(text, True)]], 0)
    with pytest.raises(TrainingError, match="rank 1's shard has no micro-batch with media none"):
        lockstep_plan([[(text, True)], []], 0)
    assert lockstep_plan([[], []], 0) == []


@pytest.fixture(scope="module")
def batch() -> TrainBatch:
    return make_batch(build_tiny_vlm(0))


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, RayDPTrainer]]:
    pytest.importorskip("ray")
    from gymbridge.trainer import init_ray

    ray = init_ray(num_cpus=2)
    model = tiny_policy(0)
    factory = functools.partial(from_config, type(model), model.config)
    trainers: dict[str, RayDPTrainer] = {}
    try:
        for strategy in ("fsdp", "replicate"):
            trainers[strategy] = RayDPTrainer(fresh(), factory, 2, worker_num_cpus=0, strategy=strategy)
        yield trainers
    finally:
        for t in trainers.values():
            t.shutdown()
        ray.shutdown()


def test_the_tiny_qwen2_vl_shards_its_decoder_layers_and_vision_blocks() -> None:
    assert no_split_classes(tiny_policy(0)) == {"Qwen2VLDecoderLayer", "Qwen2VLVisionBlock"}


def test_fsdp_step_equals_the_single_process_step(
    cluster: dict[str, RayDPTrainer], batch: TrainBatch
) -> None:
    dp = reset(cluster["fsdp"])
    local = fresh()
    fixed = with_current_logprobs(local.model, batch)
    for _ in range(2):
        want, got = local.step(fixed), dp.step(fixed)
        assert want.grad_norm > 1.0  # max_grad_norm=1 clips: the norm is the global one
        assert abs(got.loss - want.loss) <= 1e-6, (got.loss, want.loss)
        assert abs(got.grad_norm - want.grad_norm) <= 1e-5 * want.grad_norm
        assert got.num_loss_tokens == want.num_loss_tokens
    for (name, p), q in zip(dp.trainer.model.named_parameters(), local.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=name)
    digests = dp.param_digests()
    assert len(set(digests)) == 1, digests  # the driver's published copy is every rank's full weights
    assert dp.last_weights_s > 0


def test_fsdp_holds_about_half_the_replicated_state_per_rank(
    cluster: dict[str, RayDPTrainer], batch: TrainBatch
) -> None:
    fixed = with_current_logprobs(tiny_policy(0), batch)
    held: dict[str, list[dict[str, int]]] = {}
    for strategy in ("fsdp", "replicate"):
        dp = reset(cluster[strategy])
        dp.step(fixed)
        held[strategy] = dp.last_rank_state_bytes
    replicated = max(sum(b.values()) for b in held["replicate"])
    for rank in held["fsdp"]:
        assert rank["params"] and rank["grads"] and rank["optimizer"]
        assert sum(rank.values()) <= 0.55 * replicated, (held, replicated)


def test_a_failing_fsdp_shard_raises_and_the_group_trains_on(
    cluster: dict[str, RayDPTrainer], batch: TrainBatch
) -> None:
    """The failing rank's peer must not wait in an all-gather that never comes."""
    from gymbridge.errors import TrajectoryError

    dp = reset(cluster["fsdp"])
    fixed = with_current_logprobs(tiny_policy(0), batch)
    ids = fixed.input_ids.clone()
    ids[0, ids[0] == build_tiny_vlm(0).image_token_id] = 45  # row 0 loses its image placeholders
    before = dp.param_digests()
    with pytest.raises(TrajectoryError, match="placeholder"):
        dp.step(replace(fixed, input_ids=ids))
    assert dp.param_digests() == before
    local = fresh()
    want, got = local.step(fixed), dp.step(fixed)
    assert abs(got.loss - want.loss) <= 1e-6
    assert len(set(dp.param_digests())) == 1


def test_fsdp_kl_reference_and_optimizer_state_round_trip(
    cluster: dict[str, RayDPTrainer], batch: TrainBatch
) -> None:
    """A sharded KL reference scores like the driver's; the gathered AdamW state resumes the run exactly."""
    config = GRPOConfig(lr=1e-3, kl_coef=0.1, loss_agg="seq_mean_token_mean", encoder_dedup=False)
    dp = cluster["fsdp"]
    model = tiny_policy(0)
    factory = functools.partial(from_config, type(model), model.config)
    kl = RayDPTrainer(fresh(config), factory, 2, worker_num_cpus=0, strategy="fsdp")
    try:
        local = fresh(config)
        fixed = with_current_logprobs(local.model, batch)
        for _ in range(2):
            want, got = local.step(fixed), kl.step(fixed)
            assert got.loss == pytest.approx(want.loss, abs=1e-6)
            assert got.kl == pytest.approx(want.kl, abs=1e-7)
        assert want.kl > 0
    finally:
        kl.shutdown()
    dp = reset(dp)
    dp.step(fixed)
    dp.pull_optimizer_state()
    local = fresh()
    local.model.load_state_dict(dp.trainer.model.state_dict())
    local.optimizer.load_state_dict(dp.trainer.optimizer.state_dict())
    local.steps = dp.trainer.steps
    dp.trainer = fresh()
    dp.trainer.model.load_state_dict(local.model.state_dict())
    dp.trainer.optimizer.load_state_dict(local.optimizer.state_dict())
    dp.trainer.steps = local.steps
    dp.sync_workers()  # the resumed state back into the shards
    want, got = local.step(fixed), dp.step(fixed)
    assert abs(got.loss - want.loss) <= 1e-6
    for p, q in zip(dp.trainer.model.parameters(), local.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


def _image(color: tuple[int, int, int], size: int = 56) -> MediaItem:
    return MediaItem.from_bytes(png_bytes(color, size), "image", mime="image/png")


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_vl_packed_memory", "qwen2_5_omni"])
def test_fsdp_runs_uneven_mixed_media_shards_in_lockstep(
    cluster: dict[str, RayDPTrainer], family: str, tiny: TinyVLM, tiny_omni: TinyOmni
) -> None:
    """Shards with different counts of text-only and image micro-batches: the short rank repeats one
    of its own with weight 0, so both run the same FSDP units, and the step is the single process's."""
    red, blue, big = _image((200, 30, 30)), _image((20, 40, 220)), _image((20, 130, 30), 112)
    config = GRPOConfig(lr=1e-3, micro_batch_max_tokens=30)  # one row per pass: uneven pass counts
    if family.startswith("qwen2_vl"):
        policy = tiny_policy
        rows = [([red], 3), ([red, big], 8), ([], 5), ([blue], 12), ([big], 2), ([], 9)]
        batch = media_batch(tiny.tokenizer, tiny.processor, rows)
    else:
        policy = tiny_omni_policy
        clip = MediaItem.from_bytes(wav_bytes(1.0), "audio", mime="audio/wav")
        rows = [([red, clip], 5), ([blue, clip], 9), ([big, clip], 3), ([red, clip], 7)]
        batch = media_batch(tiny_omni.tokenizer, tiny_omni.processor, rows)
    if family == "qwen2_vl_packed_memory":  # packed rows, blocks recomputed, encoders frozen
        config = GRPOConfig(
            lr=1e-3,
            micro_batch_max_tokens=40,
            sequence_packing=True,
            activation_checkpointing=True,
            freeze_vision_tower=True,
        )
    model = policy(0)
    prepare_policy(model, config)
    factory = functools.partial(from_config, type(model), model.config)
    dp = RayDPTrainer(
        GRPOTrainer(model, config, on_policy=False), factory, 2, worker_num_cpus=0, strategy="fsdp"
    )
    try:
        local_model = policy(0)
        prepare_policy(local_model, config)
        local = GRPOTrainer(local_model, config, on_policy=False)
        fixed = with_current_logprobs(local.model, batch)
        want, got = local.step(fixed), dp.step(fixed)
        assert abs(got.loss - want.loss) <= 1e-6 and got.num_loss_tokens == want.num_loss_tokens
        assert got.encoder_refs == want.encoder_refs  # the repeated passes count nowhere
        for (name, p), q in zip(dp.trainer.model.named_parameters(), local.model.parameters(), strict=True):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=name)
    finally:
        dp.shutdown()


def test_smoke_run_with_fsdp_workers_reports_the_strategy_and_rank_bytes(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    from gymbridge.cli import main

    # after the module's tests the run joins their Ray (their actors reserve no CPU); alone it starts one
    argv = ["smoke", "run", "--steps", "2", "--prompts", "2", "--group-size", "4"]
    argv += ["--run-dir", str(tmp_path), "--no-progress"]
    settings = ("dp.workers=2", "dp.strategy=fsdp", "trainer.dtype=bfloat16", "warmup.steps=0")
    for setting in (*settings, "shaping.kind=token_rate", "rollout.max_tokens=16", "checkpoint.every=2"):
        argv += ["--set", setting]
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(argv) == 0
    assert "data parallel (fsdp)" in out.getvalue()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        assert r["dp_strategy"] == "fsdp" and r["dp_world_size"] == 2 and r["dp_weights_s"] > 0
        assert r["skipped"] is None and abs(r["ratio_mean"] - 1) < 1e-2  # the generator got v1
        held = r["dp_rank_state_bytes"]
        assert len(held) == 2 and all(b["params"] > 0 and b["grads"] > 0 and b["optimizer"] > 0 for b in held)
    assert [r["policy_version"] for r in records] == [1, 2]
    from gymbridge.run import load_run_config
    from gymbridge.trainer import load_checkpoint

    trainer = GRPOTrainer(tiny_policy(0).to(torch.bfloat16), load_run_config(["smoke"]).trainer)
    assert load_checkpoint(tmp_path / "checkpoints", trainer=trainer) is not None
    assert trainer.steps == 2 and trainer.optimizer.state  # the AdamW moments gathered from the shards
