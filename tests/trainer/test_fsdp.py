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
import socket
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
from gymbridge.trainer.ray_dp import LOCKSTEP_COPY, lockstep_plan, lockstep_shards, policy_shards
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
    assert plans[0] == [(2, True, ()), (0, True, ()), (1, True, ())]
    assert plans[1] == [(0, False, img), (0, True, ()), (0, False, ())]  # text: the image stripped
    shape = [[tuple(m for m in ranks[r][i][0] if m not in strip) for i, _, strip in plans[r]] for r in (0, 1)]
    assert shape[0] == shape[1]
    # a rank without an image-only micro-batch repeats one holding an image and audio, the audio stripped
    both = ("audio", "image")
    assert lockstep_plan([[(img, True), (both, True)], [(both, True)]], 1) == [
        (0, True, ()),
        (0, False, ("audio",)),
    ]
    with pytest.raises(
        TrainingError, match=r"rank 0's shard has no micro-batch with media \['audio', 'image'\]"
    ):
        lockstep_plan([[(img, True)], [(both, True)]], 0)
    with pytest.raises(TrainingError, match=r"rank 1's shard has no micro-batch with media \['image'\]"):
        lockstep_plan([[(img, True)], [(text, True)]], 0)
    with pytest.raises(TrainingError, match="rank 1's shard has no micro-batch with media none"):
        lockstep_plan([[(text, True)], []], 0)
    assert lockstep_plan([[], []], 0) == []


def _images_on_one_shard(tiny: TinyVLM) -> TrainBatch:
    """Three groups: the image rows all in group 0, which 2 shards put alone on shard 0."""
    red, blue = _image((200, 30, 30)), _image((20, 40, 220))
    rows = [([red], 3), ([blue], 6), ([], 5), ([], 9), ([], 4), ([], 7)]
    return media_batch(tiny.tokenizer, tiny.processor, rows)


def test_lockstep_shards_give_a_shard_without_images_a_masked_copy_of_one(tiny: TinyVLM) -> None:
    batch = _images_on_one_shard(tiny)
    shards = policy_shards(batch, 2, torch.float32)
    assert [bool(s.modality_rows()["image"].any()) for s in shards] == [True, False]  # the failing shape
    filled = lockstep_shards(shards)
    assert filled[0] is shards[0]
    own, added = filled[1][: len(shards[1])], filled[1][len(shards[1]) :]
    assert torch.equal(own.loss_mask, shards[1].loss_mask[:, : own.seq_len])  # its own rows unchanged
    assert torch.equal(own.sample_ids, shards[1].sample_ids)
    # one copy of the shortest image row (row 0), media with it, training nothing
    assert len(added) == 1 and added.metadata[0][LOCKSTEP_COPY]
    assert float(added.loss_mask.abs().sum()) == 0 and not added.sample_mask.any()
    assert float(added.advantages.abs().sum()) == 0
    n = int(batch.lengths[0])
    assert torch.equal(added.input_ids[0, :n], batch.input_ids[0, :n])
    for key in batch.media:
        assert torch.equal(added.media[key].materialize(), batch[[0]].media[key].materialize())
    # a text-only batch: an empty shard gets the shortest row, masked; full shards nothing
    text = batch[2:4]
    plain = policy_shards(text, 3, torch.float32)
    assert sorted(len(p) for p in plain) == [0, 1, 1]
    parts = lockstep_shards(plain)
    empty = next(i for i, p in enumerate(plain) if not len(p))
    assert all(parts[i] is p for i, p in enumerate(plain) if i != empty)
    assert len(parts[empty]) == 1 and parts[empty].metadata[0][LOCKSTEP_COPY]
    assert float(parts[empty].loss_mask.sum()) == 0 and int(parts[empty].lengths[0]) == int(
        text.lengths.min()
    )


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


def test_fsdp_trains_a_batch_whose_images_all_land_on_one_shard(
    cluster: dict[str, RayDPTrainer], tiny: TinyVLM
) -> None:
    """Regression: a rank whose shard held no image row while its peer's did raised TrainingError on
    every rank; now it repeats a masked copy of a peer's image row, and the step is the single process's.

    Parameters are compared where AdamW's first update is ``lr * sign(grad)``: an element whose
    gradient is nonzero but below AdamW's ``eps`` (one of 8192 in ``layers.0.mlp.up_proj`` here) moves
    by ``lr * grad / (|grad| + eps)``, which turns the shards' other summation order into ~1e-6.
    """
    dp = reset(cluster["fsdp"])
    local = fresh()
    fixed = with_current_logprobs(local.model, _images_on_one_shard(tiny))
    first = local.compute_gradients(local.prepare(fixed)[0]).grads
    eps = float(local.optimizer.param_groups[0]["eps"])
    steady = [(g == 0) | (g.abs() > eps) for g in first]  # a gradient of 0 stays 0 everywhere
    # ~2% (most in the vision blocks, whose gradients through the image rows are small); the rest compared
    assert sum(int((~m).sum()) for m in steady) < 0.05 * sum(m.numel() for m in steady)
    for _ in range(2):
        want, got = local.step(fixed), dp.step(fixed)
        assert abs(got.loss - want.loss) <= 1e-6, (got.loss, want.loss)
        assert abs(got.grad_norm - want.grad_norm) <= 1e-5 * want.grad_norm
        # the masked copy counts nowhere: rows, tokens, rewards, encoder references, shard tokens
        assert (got.num_rows, got.num_tokens, got.num_loss_tokens, got.encoder_refs) == (
            want.num_rows,
            want.num_tokens,
            want.num_loss_tokens,
            want.encoder_refs,
        )
        assert got.mean_reward == want.mean_reward and sum(dp.last_shard_tokens) == fixed.num_tokens
    trainable = [(n, p) for n, p in dp.trainer.model.named_parameters() if p.requires_grad]
    local_params = [p for p in local.model.parameters() if p.requires_grad]
    for (name, p), q, keep in zip(trainable, local_params, steady, strict=True):
        torch.testing.assert_close(p[keep], q[keep], atol=1e-6, rtol=0, msg=name)
    assert len(set(dp.param_digests())) == 1


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


def test_fsdp_with_cpu_offload_steps_like_the_single_process_step(
    cluster: dict[str, RayDPTrainer], batch: TrainBatch
) -> None:
    """``dp.cpu_offload``: shards, gradients and AdamW state on the host (``CPUOffloadPolicy``); the
    step is the same step."""
    model = tiny_policy(0)
    factory = functools.partial(from_config, type(model), model.config)
    offloaded = RayDPTrainer(fresh(), factory, 2, worker_num_cpus=0, strategy="fsdp", cpu_offload=True)
    try:
        local = fresh()
        fixed = with_current_logprobs(local.model, batch)
        want, got = local.step(fixed), offloaded.step(fixed)
        assert abs(got.loss - want.loss) <= 1e-6 and got.num_loss_tokens == want.num_loss_tokens
        for (name, p), q in zip(
            offloaded.trainer.model.named_parameters(), local.model.parameters(), strict=True
        ):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=name)
        held = offloaded.last_rank_state_bytes
        assert len(held) == 2 and all(b["optimizer"] > 0 for b in held)
    finally:
        offloaded.shutdown()


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
    assert "dp fsdp x2 (" in out.getvalue() and " MiB state/rank)" in out.getvalue()  # on each step's line
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


def _publish_rank(rank: int, world: int, port: int, out: object) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from gymbridge.trainer.sharding import GatheredBucket, pack_shards

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)  # rows 3, 7 and 2 over 3 ranks: short, padded and empty shards
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 7), torch.nn.Embedding(2, 4))
    want = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    fully_shard(model[0])
    fully_shard(model)
    params = dict(model.named_parameters())
    flat, slots, others = pack_shards(params, list(params), torch.bfloat16, world, torch.device("cpu"))
    parts = [torch.empty_like(flat) for _ in range(world)] if rank == 0 else None
    dist.gather(flat, parts, dst=0)
    if parts is not None:
        got = GatheredBucket(
            "bfloat16", slots, tuple(p.view(torch.uint8).numpy() for p in parts), {}
        ).tensors()
        out.put((others, sorted(got) == sorted(want), all(torch.equal(got[n], want[n]) for n in want)))  # type: ignore[attr-defined]
    dist.destroy_process_group()


def test_publication_buckets_rebuild_unevenly_sharded_parameters_exactly() -> None:
    """Each rank's rows in one padded flat buffer, one gather: rank 0 rebuilds every full tensor."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_publish_rank, args=(r, 3, port, out)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        assert out.get(timeout=300) == ([], True, True)
    finally:
        for p in procs:
            p.join(timeout=60)


def test_smoke_color_tool_run_trains_on_fsdp_workers_when_a_shard_has_no_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tool variant (the image arrives after the forced ``look`` call) trains on 2 FSDP workers,
    every step's shards through :func:`lockstep_shards`. Here every rollout's row carries the tool's
    image (the native history appends, one row per rollout), so the shard without an image is
    exercised by ``test_fsdp_trains_a_batch_whose_images_all_land_on_one_shard``; ``lacking`` records
    per step how many shards held no image while a peer's did."""
    pytest.importorskip("ray")
    from gymbridge.cli import main
    from gymbridge.trainer import ray_dp

    lacking: list[int] = []

    def spy(shards: list[TrainBatch]) -> list[TrainBatch]:
        held = [bool(s.modality_rows().get("image", torch.zeros(0)).any()) for s in shards]
        lacking.append(sum(1 for h in held if not h) if any(held) else 0)
        return lockstep_shards(shards)

    monkeypatch.setattr(ray_dp, "lockstep_shards", spy)
    argv = ["smoke", "run", "--config", "smoke_color_tool", "--steps", "3", "--prompts", "2"]
    argv += ["--group-size", "2", "--run-dir", str(tmp_path), "--no-progress"]
    settings = ("dp.workers=2", "dp.strategy=fsdp", "warmup.steps=0", "checkpoint.every=0")
    for setting in (*settings, "shaping.kind=token_rate", "rollout.max_tokens=16"):  # a reward to learn
        argv += ["--set", setting]
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(argv) == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(r["dp_strategy"] == "fsdp" for r in records), out.getvalue()
    assert [r["policy_version"] for r in records] == [1, 2, 3]
    assert len(lacking) == 3, lacking
    assert all(r["skipped"] is None and r["num_loss_tokens"] > 0 for r in records)
