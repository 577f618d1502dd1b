"""Ray DP workers in one torch.distributed group: parity with one process, dedup across Ray, the drift guard.

One module-scoped local Ray (2 CPUs, no dashboard) and two DP trainers over it (1 and 2 workers,
half a CPU each) serve every test; each test starts both from the seed-0 weights and fresh
optimizers (``sync_workers``).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
from trainer_helpers import make_batch, with_current_logprobs

from gymbridge.metrics import PayloadMeter
from gymbridge.models.tiny_vlm import build_tiny_vlm
from gymbridge.tensors import TrainBatch
from gymbridge.trainer import (
    GRPOConfig,
    GRPOTrainer,
    RayDPTrainer,
    from_config,
    param_digest,
    require_ray,
    tiny_policy,
)
from gymbridge.trainer.ray_dp import policy_shards

pytestmark = [
    pytest.mark.integration,
    # a hang guard: Ray's start-up and three DP steps took over 300 s in a clean-clone CI run with a
    # core kept busy beside it (tests/test_no_time_budgets.py: guards >= 5x a loaded machine's time)
    pytest.mark.timeout(1500),
]

# two rows per micro-batch: every worker accumulates over micro-batches before the reduction
# Media materialised per reference (encoder_dedup off): the bit-identity of dedup on vs off below holds
# for transport; encoding a shared image once sums its rows' encoder gradients in another order (equal
# within fp32 tolerance, tests/trainer/test_encoder_dedup.py), so losses after an update differ in the
# last bits. The DP launcher test (test_smoke_dp.py) runs the encoder dedup default through the workers.
CONFIG = GRPOConfig(lr=1e-3, micro_batch_max_tokens=40, encoder_dedup=False)


def test_missing_ray_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"gymbridge\[ray\]"):
        require_ray()


@pytest.fixture(scope="module")
def batch() -> TrainBatch:
    return make_batch(build_tiny_vlm(0))


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[dict[int, RayDPTrainer], PayloadMeter, Any]]:
    pytest.importorskip("ray")
    from gymbridge.trainer import init_ray

    ray = init_ray(num_cpus=2)
    model = tiny_policy(0)
    meter = PayloadMeter(enabled=True)
    factory = functools.partial(from_config, type(model), model.config)
    trainers = {
        n: RayDPTrainer(fresh(), factory, n, meter=meter if n == 2 else None, worker_num_cpus=0.5)
        for n in (1, 2)
    }
    try:
        yield trainers, meter, ray
    finally:
        for t in trainers.values():
            t.shutdown()
        ray.shutdown()


def fresh() -> GRPOTrainer:
    # the tests step one batch several times on purpose: off-policy, no drift guard
    return GRPOTrainer(tiny_policy(0), CONFIG, on_policy=False)


def reset(dp: RayDPTrainer) -> RayDPTrainer:
    dp.trainer = fresh()
    dp.sync_workers()
    return dp


def test_dp_0_1_2_give_the_same_loss_and_grad_norm_over_three_steps(
    cluster: tuple[dict[int, RayDPTrainer], PayloadMeter, Any], batch: TrainBatch
) -> None:
    trainers, _meter, _ = cluster
    local = fresh()
    fixed = with_current_logprobs(local.model, batch)
    dp1, dp2 = reset(trainers[1]), reset(trainers[2])
    assert dp2.backend == "gloo" and dp2.num_gpus == 0
    for _ in range(3):
        want = local.step(fixed)
        assert want.grad_norm > 1e-3 and want.num_loss_tokens > 0  # a real update each step
        for dp in (dp1, dp2):
            got = dp.step(fixed)
            assert abs(got.loss - want.loss) <= 1e-6, (dp.num_workers, got.loss, want.loss)
            assert abs(got.grad_norm - want.grad_norm) <= 1e-6, (dp.num_workers, got.grad_norm)
            assert got.num_loss_tokens == want.num_loss_tokens
    for dp in (dp1, dp2):
        digests = dp.param_digests()
        assert len(digests) == dp.num_workers + 1 and len(set(digests)) == 1, digests  # driver == every rank
        for (name, p), q in zip(dp.trainer.model.named_parameters(), local.model.parameters(), strict=True):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=name)
    assert param_digest(dp2.trainer.model) != param_digest(tiny_policy(0))  # and they did train


def test_dedup_on_and_off_give_bit_identical_losses(
    cluster: tuple[dict[int, RayDPTrainer], PayloadMeter, Any], batch: TrainBatch
) -> None:
    trainers, meter, _ = cluster
    copies = with_current_logprobs(tiny_policy(0), make_batch(build_tiny_vlm(0), dedup=False))
    shared = replace(copies, media=batch.media)  # the same rows, media deduplicated
    runs: list[list[tuple[float, float]]] = []
    sent: list[int] = []
    for b in (shared, copies):
        dp = reset(trainers[2])
        meter.reset()
        runs.append([(m.loss, m.grad_norm) for m in (dp.step(b) for _ in range(2))])
        sent.append(meter.report()["policy_shard"].physical_media_bytes)
    assert runs[0] == runs[1]  # bit-identical
    assert sent[0] * 4 == sent[1]  # 4 rollouts per image: dedup sends each once


def test_policy_shards_stay_deduplicated_across_ray(
    cluster: tuple[dict[int, RayDPTrainer], PayloadMeter, Any], batch: TrainBatch
) -> None:
    trainers, meter, ray = cluster
    trainer = reset(trainers[2])
    meter.reset()
    shards = batch.shard(2, group_aware=True)
    trainer.step(batch)
    report = meter.report()["policy_shard"]
    assert report.records == 2 and set(report.shard_serialized_bytes) == {0, 1}
    # group-aware: one prompt (one image) per shard -> 2 media keys x 1 segment each
    assert [s.media["pixel_values"].num_segments for s in shards] == [1, 1]
    assert report.num_segments == 4 and report.num_refs == 16
    assert report.logical_media_bytes == 4 * report.physical_media_bytes
    # what a worker receives is what was sent: still one segment per image, same provenance
    back = ray.get(ray.put(shards[0]))
    assert back.media["pixel_values"].num_segments == 1
    assert back.media["pixel_values"].provenance == shards[0].media["pixel_values"].provenance
    assert report.max_shard_bytes < batch.media_logical_nbytes / 2
    assert trainer.last_shard_tokens == [s.num_tokens for s in shards]


def test_policy_shards_cast_floating_media_only_and_leave_the_batch_alone(batch: TrainBatch) -> None:
    meter = PayloadMeter(enabled=True)
    for dtype in (torch.float32, torch.bfloat16):
        meter.reset()
        for i, s in enumerate(policy_shards(batch, 2, dtype)):
            assert s.media["pixel_values"].dtype == dtype
            assert s.media["image_grid_thw"].dtype == torch.int64  # metadata never cast
            meter.record("policy_shard", s, shard=i)
        if dtype == torch.float32:
            full = meter.report()["policy_shard"].physical_media_bytes
    half = meter.report()["policy_shard"].physical_media_bytes
    grid = sum(s.media["image_grid_thw"].physical_nbytes for s in batch.shard(2))
    assert half - grid == (full - grid) // 2  # the pixels cross in half the bytes
    assert batch.media["pixel_values"].dtype == torch.float32  # the Gym return keeps its dtype


def test_regression_dp_step_without_loss_tokens_moves_no_weights(
    cluster: tuple[dict[int, RayDPTrainer], PayloadMeter, Any], batch: TrainBatch
) -> None:
    """A fully masked batch used to step every optimizer (momentum moved the weights)."""
    trainers, _meter, _ = cluster
    trainer = reset(trainers[2])
    trainer.step(batch)  # the optimizers now hold momentum
    before = trainer.param_digests()
    masked = replace(batch, loss_mask=torch.zeros_like(batch.loss_mask))
    metrics = trainer.step(masked)
    assert metrics.num_loss_tokens == 0 and metrics.grad_norm == 0.0
    assert trainer.param_digests() == before and len(set(before)) == 1


def test_dp_drift_guard_fails_before_any_worker_moves(
    cluster: tuple[dict[int, RayDPTrainer], PayloadMeter, Any], batch: TrainBatch
) -> None:
    from gymbridge.errors import PolicyDriftError

    trainers, _meter, _ = cluster
    trainer = reset(trainers[2])
    stale = with_current_logprobs(tiny_policy(1), batch)  # logprobs of another model's weights
    before = trainer.param_digests()
    trainer.trainer.on_policy = True
    with pytest.raises(PolicyDriftError, match="the generator's weights are not the trainer's"):
        trainer.step(stale)
    assert trainer.param_digests() == before
    trainer.trainer.on_policy = False
    trainer.step(with_current_logprobs(tiny_policy(0), batch))  # the group still works after a refusal
    assert len(set(trainer.param_digests())) == 1


def test_a_failing_shard_raises_its_error_and_the_group_survives(
    cluster: tuple[dict[int, RayDPTrainer], PayloadMeter, Any], batch: TrainBatch
) -> None:
    """A worker's bad shard must not leave its peer waiting on an all-reduce that never comes."""
    from gymbridge.errors import TrajectoryError

    trainers, _meter, _ = cluster
    trainer = reset(trainers[2])
    ids = batch.input_ids.clone()
    ids[0, ids[0] == build_tiny_vlm(0).image_token_id] = 45  # row 0 loses its image placeholders
    bad = replace(batch, input_ids=ids)
    before = trainer.param_digests()
    with pytest.raises(TrajectoryError, match="placeholder"):
        trainer.step(bad)
    assert trainer.param_digests() == before
    trainer.step(batch)
    assert len(set(trainer.param_digests())) == 1


def test_ray_address_joins_an_existing_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """``init_ray(address=...)`` (``ray_address`` in the launcher config) joins, never starts a local Ray."""
    ray = pytest.importorskip("ray")
    from gymbridge.trainer import init_ray

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    init_ray(4, address="ray://head.example:10001")
    init_ray(3)
    assert calls[0]["address"] == "ray://head.example:10001" and "num_cpus" not in calls[0]
    assert calls[1]["num_cpus"] == 3 and "address" not in calls[1]


def test_a_checkpointed_dp_state_resumes_bit_identically(
    cluster: tuple[dict[int, RayDPTrainer], PayloadMeter, Any], batch: TrainBatch
) -> None:
    """What the launcher checkpoints (the driver's weights + rank 0's optimizer state) resumes exactly."""
    import copy

    trainers, _meter, _ = cluster
    dp = reset(trainers[2])
    dp.step(batch)
    assert not dp.trainer.optimizer.state  # the driver never steps: its AdamW is blank until pulled
    dp.pull_optimizer_state()
    saved = copy.deepcopy((dp.trainer.model.state_dict(), dp.trainer.optimizer.state_dict()))
    went_on = dp.step(batch)
    after = dp.param_digests()
    resumed = fresh()  # a new process: fresh model, then the checkpoint's state
    resumed.model.load_state_dict(saved[0])
    resumed.optimizer.load_state_dict(saved[1])
    resumed.steps = 1
    dp.trainer = resumed
    dp.sync_workers()
    again = dp.step(batch)
    assert (again.loss, again.grad_norm) == (went_on.loss, went_on.grad_norm)
    assert dp.param_digests() == after and dp.trainer.steps == 2


def test_dp_runs_the_grpo_variants_like_a_single_process(
    cluster: tuple[dict[int, RayDPTrainer], PayloadMeter, Any], batch: TrainBatch
) -> None:
    """KL to each worker's own frozen reference, seq-mean aggregation and mask_truncated: shards sum up."""
    config = GRPOConfig(lr=1e-3, kl_coef=0.1, loss_agg="seq_mean_token_mean", mask_truncated=True)
    model = tiny_policy(0)
    factory = functools.partial(from_config, type(model), model.config)
    # the module's actors hold the local Ray's CPUs: these two take none
    trainer = RayDPTrainer(GRPOTrainer(model, config, on_policy=False), factory, 2, worker_num_cpus=0)
    try:
        local = GRPOTrainer(tiny_policy(0), config, on_policy=False)
        fixed = with_current_logprobs(local.model, batch)
        meta = list(fixed.metadata)
        meta[1] = {**meta[1], "incomplete_reason": "max_output_tokens"}  # one truncated rollout
        fixed = dataclasses.replace(fixed, metadata=tuple(meta))
        for _ in range(3):
            got, want = trainer.step(fixed), local.step(fixed)
            assert got.loss == pytest.approx(want.loss, abs=1e-6)
            assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-4)
            assert got.kl == pytest.approx(want.kl, abs=1e-7)
            assert got.truncated_masked == want.truncated_masked == 1
        assert want.kl > 0
        assert len(set(trainer.param_digests())) == 1
    finally:
        trainer.shutdown()
