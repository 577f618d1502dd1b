"""Ray DP workers: deduplicated shards across the Ray boundary, exact summed gradients, identical weights.

One module-scoped local Ray (2 CPUs, no dashboard) and one pair of actors serve every test.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from trainer_helpers import make_batch, with_current_logprobs

from gymbridge.metrics import PayloadMeter
from gymbridge.tensors import TrainBatch
from gymbridge.testing.tiny_vlm import build_tiny_vlm
from gymbridge.trainer import (
    GRPOConfig,
    GRPOTrainer,
    RayDPTrainer,
    from_config,
    param_digest,
    require_ray,
    tiny_policy,
)

pytestmark = pytest.mark.integration

CONFIG = GRPOConfig(lr=1e-3)


def test_missing_ray_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"gymbridge\[ray\]"):
        require_ray()


@pytest.fixture(scope="module")
def batch() -> TrainBatch:
    return make_batch(build_tiny_vlm(0))


@pytest.fixture(scope="module")
def dp(batch: TrainBatch) -> Iterator[tuple[RayDPTrainer, PayloadMeter, Any]]:
    pytest.importorskip("ray")
    from gymbridge.trainer import init_ray

    ray = init_ray(num_cpus=2)
    model = tiny_policy(0)
    meter = PayloadMeter(enabled=True)
    trainer = RayDPTrainer(
        GRPOTrainer(model, CONFIG, on_policy=False),  # the tests step one batch twice, on purpose
        functools.partial(from_config, type(model), model.config),
        2,
        meter=meter,
    )
    try:
        yield trainer, meter, ray
    finally:
        trainer.shutdown()
        ray.shutdown()


def test_dp_step_equals_a_single_process_step_and_weights_stay_identical(
    dp: tuple[RayDPTrainer, PayloadMeter, Any], batch: TrainBatch
) -> None:
    trainer, _meter, _ = dp
    local = GRPOTrainer(tiny_policy(0), CONFIG, on_policy=False)
    fixed = with_current_logprobs(local.model, batch)
    assert trainer.param_digests()[0] == param_digest(local.model)
    for _ in range(2):
        got = trainer.step(fixed)
        want = local.step(fixed)
        assert got.loss == pytest.approx(want.loss, abs=1e-6)
        assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-4)
    for (name, p), q in zip(trainer.trainer.model.named_parameters(), local.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=name)
    digests = trainer.param_digests()
    assert len(digests) == 3 and len(set(digests)) == 1, digests  # driver + 2 workers, bit-identical
    assert digests[0] != param_digest(tiny_policy(0))  # and they did train


def test_policy_shards_stay_deduplicated_across_ray(
    dp: tuple[RayDPTrainer, PayloadMeter, Any], batch: TrainBatch
) -> None:
    trainer, meter, ray = dp
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


def test_regression_dp_step_without_loss_tokens_moves_no_weights(
    dp: tuple[RayDPTrainer, PayloadMeter, Any], batch: TrainBatch
) -> None:
    """A fully masked batch used to step every optimizer (momentum moved the weights)."""
    from dataclasses import replace

    trainer, _meter, _ = dp
    trainer.step(batch)  # the optimizers now hold momentum
    before = trainer.param_digests()
    masked = replace(batch, loss_mask=torch.zeros_like(batch.loss_mask))
    metrics = trainer.step(masked)
    assert metrics.num_loss_tokens == 0 and metrics.grad_norm == 0.0
    assert trainer.param_digests() == before and len(set(before)) == 1


def test_dp_drift_guard_fails_before_any_worker_moves(
    dp: tuple[RayDPTrainer, PayloadMeter, Any], batch: TrainBatch
) -> None:
    from gymbridge.errors import PolicyDriftError

    trainer, _meter, _ = dp
    stale = with_current_logprobs(tiny_policy(1), batch)  # logprobs of another model's weights
    before = trainer.param_digests()
    trainer.trainer.on_policy = True
    try:
        with pytest.raises(PolicyDriftError, match="the generator's weights are not the trainer's"):
            trainer.step(stale)
    finally:
        trainer.trainer.on_policy = False
    assert trainer.param_digests() == before


def test_dp_runs_the_grpo_variants_like_a_single_process(
    dp: tuple[RayDPTrainer, PayloadMeter, Any], batch: TrainBatch
) -> None:
    """KL to each worker's own frozen reference, seq-mean aggregation and mask_truncated: shards sum up."""
    config = GRPOConfig(lr=1e-3, kl_coef=0.1, loss_agg="seq_mean_token_mean", mask_truncated=True)
    model = tiny_policy(0)
    factory = functools.partial(from_config, type(model), model.config)
    # the module's two actors hold both CPUs of the local Ray: these two take none
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
