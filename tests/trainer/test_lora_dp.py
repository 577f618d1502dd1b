"""LoRA on Ray DP workers (``dp.workers > 0``, both strategies) trains the single process's LoRA step.

One module-scoped local Ray (2 CPUs) and two LoRA DP trainers over it (tiny Qwen2-VL, rank-8
adapters, 2 workers each: ``replicate`` and ``fsdp``, no CPUs reserved) serve the parity,
publication and checkpoint tests; each test starts them from the same seeded adapters and fresh
optimizers (``sync_workers``). The KL test starts its own trainers (the workers take the trainer's
config when they start).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from trainer_helpers import make_batch, with_current_logprobs

from gymbridge.errors import CheckpointError
from gymbridge.generation.lora import (
    LoRAConfig,
    apply_lora,
    is_adapter_name,
    lora_settings,
    published_names,
)
from gymbridge.models.tiny_vlm import build_tiny_vlm
from gymbridge.tensors import TrainBatch
from gymbridge.trainer import GRPOConfig, GRPOTrainer, RayDPTrainer, from_config, tiny_policy
from gymbridge.trainer.ray_dp import DPStrategy, fsdp_load_states
from gymbridge.trainer.sharded_checkpoint import (
    iter_full_tensors,
    restore_model_and_optimizer,
    sharded_checkpoint_lora,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

LORA = LoRAConfig(rank=8)
CONFIG = GRPOConfig(lr=1e-3, micro_batch_max_tokens=40, encoder_dedup=False, lora=LORA)
STRATEGIES: tuple[DPStrategy, ...] = ("replicate", "fsdp")


def lora_policy(config: GRPOConfig = CONFIG) -> torch.nn.Module:
    """The seed-0 tiny policy with the seed-0 adapters (``B`` zero, ``A`` random), as the driver holds it."""
    model = tiny_policy(0)
    torch.manual_seed(0)
    apply_lora(model, config.lora)
    return model


def fresh(config: GRPOConfig = CONFIG) -> GRPOTrainer:
    # one batch stepped several times on purpose: off-policy, no drift guard
    return GRPOTrainer(lora_policy(config), config, on_policy=False)


def reset(dp: RayDPTrainer) -> RayDPTrainer:
    dp.trainer = fresh(dp.trainer.config)
    dp.sync_workers()
    return dp


def factory() -> functools.partial[torch.nn.Module]:
    """What the driver gives the workers: the plain model's class and config (no adapters)."""
    model = tiny_policy(0)
    return functools.partial(from_config, type(model), model.config)


def adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if is_adapter_name(n)}


def steady(trainer: GRPOTrainer, batch: TrainBatch, masks: dict[str, torch.Tensor]) -> None:
    """AND into ``masks`` the adapter elements whose gradient on ``batch`` is 0 or above AdamW's ``eps``.

    AdamW moves an element by ``lr * m / (sqrt(v) + eps)``: with a gradient below ``eps`` (one of the
    16384 adapter elements at the second step here) that is ``lr * g / (|g| + eps)``, which turns the
    shards' other summation order into ~1e-6; the other elements move by ``lr`` whatever the order."""
    grads = trainer.compute_gradients(trainer.prepare(batch)[0]).grads
    eps = float(trainer.optimizer.param_groups[0]["eps"])
    names = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    for name, g in zip(names, grads, strict=True):
        keep = (g == 0) | (g.abs() > eps)
        masks[name] = masks[name] & keep if name in masks else keep


def on_worker(dp: RayDPTrainer, rank: int, what: str) -> object:
    """``what`` read from rank ``rank``'s trainer (``lora``, ``reference``, ``kl_reference``)."""
    return dp.ray.get(dp.workers[rank].__ray_call__.remote(lambda w: getattr(w.trainer, what)))


@pytest.fixture(scope="module")
def batch() -> TrainBatch:
    return make_batch(build_tiny_vlm(0))


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, RayDPTrainer]]:
    pytest.importorskip("ray")
    from gymbridge.trainer import init_ray

    ray = init_ray(num_cpus=2)
    trainers: dict[str, RayDPTrainer] = {}
    try:
        for strategy in STRATEGIES:
            trainers[strategy] = RayDPTrainer(fresh(), factory(), 2, worker_num_cpus=0, strategy=strategy)
        yield trainers
    finally:
        for t in trainers.values():
            t.shutdown()
        ray.shutdown()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lora_dp_step_equals_the_single_process_lora_step(
    cluster: dict[str, RayDPTrainer], batch: TrainBatch, strategy: str
) -> None:
    dp = reset(cluster[strategy])
    local = fresh()
    base = {n: t.clone() for n, t in dp.trainer.model.state_dict().items() if not is_adapter_name(n)}
    assert on_worker(dp, 0, "lora") is True and on_worker(dp, 1, "lora") is True
    fixed = with_current_logprobs(local.model, batch)
    masks: dict[str, torch.Tensor] = {}
    for _ in range(2):  # the first step moves only B (A's gradient is B's, zero); the second both
        steady(local, fixed, masks)
        want, got = local.step(fixed), dp.step(fixed)
        assert want.grad_norm > 1e-3 and want.num_loss_tokens > 0
        assert abs(got.loss - want.loss) <= 1e-6, (got.loss, want.loss)
        assert abs(got.grad_norm - want.grad_norm) <= 1e-5 * want.grad_norm
        assert got.num_loss_tokens == want.num_loss_tokens
    mine, theirs = adapters(dp.trainer.model), adapters(local.model)
    assert sorted(mine) == sorted(masks) == sorted(published_names(local.model) or ())
    assert sum(int((~m).sum()) for m in masks.values()) < 1e-3 * sum(m.numel() for m in masks.values())
    for name, p in mine.items():
        torch.testing.assert_close(p[masks[name]], theirs[name][masks[name]], atol=1e-6, rtol=0, msg=name)
        torch.testing.assert_close(p, theirs[name], atol=1e-5, rtol=0, msg=name)  # the rest within lr / 100
    assert any(not torch.equal(p, adapters(lora_policy())[n]) for n, p in mine.items())  # they trained
    # the driver's copy (the publication source) is every rank's; its base never moved
    digests = dp.param_digests()
    assert len(digests) == 3 and len(set(digests)) == 1, digests
    for name, t in dp.trainer.model.state_dict().items():
        if name in base:
            assert torch.equal(t, base[name]), name


def test_only_the_adapters_come_back_to_the_driver(cluster: dict[str, RayDPTrainer]) -> None:
    from gymbridge.trainer.ray_dp import _published_state

    dp = cluster["fsdp"]
    names = published_names(dp.trainer.model)
    assert names and all(is_adapter_name(n) for n in names)
    assert sorted(n for bucket in dp.publish_buckets() for n in bucket) == sorted(names)
    assert set(_published_state(dp.trainer.model)) == names  # what a replicated rank 0 sends
    # fsdp's rank 0 broadcasts the base once at setup; no reference weights travel with LoRA
    lead, light = fsdp_load_states(dp.trainer)
    assert lead["reference"] == {} and light["model"] == {}


def test_lora_fsdp_ranks_hold_adapter_sized_gradients_and_optimizer_state(
    cluster: dict[str, RayDPTrainer], batch: TrainBatch
) -> None:
    """Frozen base weights and trainable adapters share FSDP units: the base is sharded but never has
    a gradient or AdamW state; what the ranks hold of those is the adapters' share, half each."""
    dp = reset(cluster["fsdp"])
    dp.step(with_current_logprobs(dp.trainer.model, batch))
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapters(dp.trainer.model).values())
    total_bytes = sum(p.numel() * p.element_size() for p in dp.trainer.model.parameters())
    held = dp.last_rank_state_bytes
    assert len(held) == 2
    for rank in held:
        assert 0 < rank["grads"] <= adapter_bytes // 2 + 4096, held  # ceil-chunked rows: a little over half
        assert rank["optimizer"] <= 2 * (adapter_bytes // 2 + 4096) + 64, held  # two moments + steps
        assert total_bytes // 2 - 4096 <= rank["params"] <= total_bytes // 2 + 4096, held
    assert sum(r["grads"] for r in held) == adapter_bytes


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lora_kl_reference_is_the_base_on_every_rank_with_no_reference_copy(
    cluster: dict[str, RayDPTrainer], batch: TrainBatch, strategy: DPStrategy
) -> None:
    config = GRPOConfig(lr=1e-3, kl_coef=0.1, loss_agg="seq_mean_token_mean", encoder_dedup=False, lora=LORA)
    dp = RayDPTrainer(fresh(config), factory(), 2, worker_num_cpus=0, strategy=strategy)
    try:
        assert dp.trainer.reference is None and dp.trainer.kl_reference == "base_adapters_off"
        for rank in (0, 1):
            assert on_worker(dp, rank, "reference") is None
            assert on_worker(dp, rank, "kl_reference") == "base_adapters_off"
        local = fresh(config)
        fixed = with_current_logprobs(local.model, batch)
        masks: dict[str, torch.Tensor] = {}
        for _ in range(2):
            steady(local, fixed, masks)
            want, got = local.step(fixed), dp.step(fixed)
            assert got.loss == pytest.approx(want.loss, abs=1e-6)
            assert got.kl == pytest.approx(want.kl, abs=1e-7)
        assert want.kl > 0  # the adapters moved the policy away from its base
        theirs = adapters(local.model)
        for name, p in adapters(dp.trainer.model).items():
            keep = masks[name]
            torch.testing.assert_close(p[keep], theirs[name][keep], atol=1e-6, rtol=0, msg=name)
        assert len(set(dp.param_digests())) == 1
    finally:
        dp.shutdown()


def test_a_lora_fsdp_sharded_checkpoint_holds_the_adapters_and_loads_into_one_process(
    cluster: dict[str, RayDPTrainer], batch: TrainBatch, tmp_path: Path
) -> None:
    dp = reset(cluster["fsdp"])
    fixed = with_current_logprobs(dp.trainer.model, batch)
    for _ in range(2):
        dp.step(fixed)
    folder = tmp_path / "step-2"
    dp.save_sharded_checkpoint(folder, {"run_step": 2})
    dp.pull_optimizer_state()  # the driver's AdamW: every rank's state gathered, to compare with
    settings = lora_settings(dp.trainer.model)
    assert sharded_checkpoint_lora(folder) == settings
    names = published_names(dp.trainer.model)
    saved = dict(iter_full_tensors(folder, prefix="model."))
    assert {n.removeprefix("model.") for n in saved} == names  # no base weight, no reference
    for name, t in saved.items():
        assert torch.equal(t, dp.trainer.model.get_parameter(name.removeprefix("model."))), name

    # one process, a fresh base with the same adapters (their values random until the load)
    model = tiny_policy(0)
    assert settings is not None
    apply_lora(model, settings)
    local = GRPOTrainer(model, CONFIG, on_policy=False)
    restore_model_and_optimizer(local.model, local.optimizer, folder)
    assert torch.equal(
        torch.cat([p.flatten() for p in adapters(local.model).values()]),
        torch.cat([p.flatten() for p in adapters(dp.trainer.model).values()]),
    )
    want = dp.trainer.optimizer.state_dict()["state"]
    got = local.optimizer.state_dict()["state"]
    assert sorted(got) == sorted(want) and len(got) == len(names)
    for i, state in want.items():
        for key, value in state.items():
            torch.testing.assert_close(got[i][key], value, atol=0, rtol=0, msg=f"{i}.{key}")
    # then both take the same next step
    want_step, got_step = local.step(fixed), dp.step(fixed)
    assert abs(got_step.loss - want_step.loss) <= 1e-6
    assert abs(got_step.grad_norm - want_step.grad_norm) <= 1e-5 * want_step.grad_norm

    # and back into the 2 ranks (each reads its slices): driver and ranks hold the saved adapters again
    dp.load_sharded_checkpoint(folder)
    with torch.no_grad():
        for name, t in saved.items():
            dp.trainer.model.get_parameter(name.removeprefix("model.")).copy_(t)
    assert len(set(dp.param_digests())) == 1

    # a whole model, or other adapters, is refused naming the checkpoint
    plain = GRPOTrainer(tiny_policy(0), GRPOConfig(lr=1e-3), on_policy=False)
    with pytest.raises(CheckpointError, match="LoRA adapters only"):
        restore_model_and_optimizer(plain.model, plain.optimizer, folder)
    other = tiny_policy(0)
    apply_lora(other, LoRAConfig(rank=4))
    wide = GRPOTrainer(other, GRPOConfig(lr=1e-3), on_policy=False)
    with pytest.raises(CheckpointError, match="r 8 saved, 4 here"):
        restore_model_and_optimizer(wide.model, wide.optimizer, folder)
