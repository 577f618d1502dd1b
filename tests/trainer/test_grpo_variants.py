"""The GRPO variants (top-p, KL to a frozen reference, loss aggregation, overlong masking) on the tiny VLM."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trainer_helpers import image, trajectory, with_current_logprobs

from gymbridge.errors import CheckpointError, SamplingMismatchError
from gymbridge.generation.hf import HFGenerator
from gymbridge.generation.types import SamplingConfig
from gymbridge.models.tiny_vlm import TinyVLM
from gymbridge.tensors import MediaProcessor, TrainBatch
from gymbridge.trainer import (
    GRPOConfig,
    GRPOTrainer,
    grpo_token_loss,
    param_digest,
    tiny_policy,
    token_logprobs,
)
from gymbridge.trainer.checkpoint import load_checkpoint, save_checkpoint
from gymbridge.trainer.grpo import LossAgg, kl_estimate, nucleus_logprobs
from gymbridge.trajectory import GenerationInput, Trajectory, Turn, from_gym_result

MODES: tuple[LossAgg, ...] = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")


def _varied_batch(tiny: TinyVLM, *, metadata: dict[int, dict[str, Any]] | None = None) -> TrainBatch:
    """2 prompts x 4 completions of 1 to 5 tokens (so the aggregation modes differ); rewards 1, 0."""
    trajs: list[Trajectory] = []
    for g in range(2):
        img = image((40 * g + 20, 90, 200 - 30 * g))
        for r in range(4):
            gen = [*[60 + r, 70 + g, 80, 81, 82][: 1 + (r + 2 * g) % 5], tiny.eos_token_id]
            t = trajectory(tiny, img, gen, reward=float(r % 2 == 0), task=g, rollout=r)
            meta = (metadata or {}).get(4 * g + r)
            trajs.append(replace(t, metadata=meta) if meta else t)
    return TrainBatch.from_trajectories(trajs, MediaProcessor(tiny.processor), group_size=4)


def _off_policy(model: torch.nn.Module, batch: TrainBatch) -> TrainBatch:
    """``batch`` with old logprobs a little off the model's own (ratios != 1, some clipped)."""
    fixed = with_current_logprobs(model, batch)
    wobble = torch.linspace(-0.3, 0.3, fixed.logprobs.numel()).reshape(fixed.logprobs.shape)
    return replace(fixed, logprobs=(fixed.logprobs + wobble) * fixed.loss_mask)


# ------------------------------------------------------------------ top-p


def _generated_batch(tiny: TinyVLM, model: torch.nn.Module, top_p: float) -> TrainBatch:
    gen = HFGenerator(model, tiny.processor)
    prompts = [[tiny.im_start_token_id, 40 + k, 41, 42, 44, 45] for k in range(3)]
    inputs = [GenerationInput(p) for p in prompts for _ in range(4)]
    sampling = SamplingConfig(temperature=1.0, top_p=top_p, max_tokens=12, seed=3)
    outs = asyncio.run(gen.generate(inputs, sampling))
    trajs = []
    for i, (inp, out) in enumerate(zip(inputs, outs, strict=True)):
        turn = Turn(0, 1, "message", 0, inp.prompt_token_ids, out.token_ids, out.logprobs)
        meta = {"sampling": {"temperature": 1.0, "top_p": top_p}}
        traj = Trajectory([turn], reward=float(i % 2), task_index=i // 4, rollout_index=i % 4, metadata=meta)
        trajs.append(traj)
    return TrainBatch.from_trajectories(trajs, None, group_size=4, pad_token_id=0)


def test_top_p_ratio_is_one_against_a_real_hf_generation(tiny: TinyVLM) -> None:
    """HFGenerator samples at top_p=0.7 (TopPLogitsWarper); the trainer's nucleus gives ratio 1."""
    model = tiny_policy(0)
    batch = _generated_batch(tiny, model, 0.7)
    res = GRPOTrainer(model, GRPOConfig(top_p=0.7)).compute_gradients(batch)
    assert res.loss_tokens > 20
    assert res.first_ratio_mean == pytest.approx(1.0, abs=1e-5)
    assert res.first_max_abs_log < 1e-4
    assert res.outside_top_p_tokens == 0  # every sampled token is in the trainer's nucleus
    # without the nucleus the ratio is biased: the random model spreads its mass over many tokens
    with torch.no_grad():
        plain = token_logprobs(model, batch)
    gap = ((plain - batch.logprobs) * batch.loss_mask).abs().max()
    assert float(gap) > 0.05


def test_top_p_step_reports_the_fraction_outside_the_nucleus(tiny: TinyVLM) -> None:
    """Tokens no nucleus would hold are scored (finite), and counted, never silently."""
    model = tiny_policy(0)
    batch = with_current_logprobs(model, _varied_batch(tiny))  # scripted tokens: mostly improbable
    metrics = GRPOTrainer(model, GRPOConfig(top_p=0.05), on_policy=False).step(batch)
    assert 0.0 < metrics.top_p_outside_fraction <= 1.0
    assert torch.isfinite(torch.tensor([metrics.loss, metrics.grad_norm, metrics.mean_ratio])).all()


def test_rows_sampled_with_another_top_p_are_refused(tiny: TinyVLM) -> None:
    model = tiny_policy(0)
    batch = _varied_batch(tiny, metadata={3: {"sampling": {"temperature": 1.0, "top_p": 0.9}}})
    before = param_digest(model)
    with pytest.raises(SamplingMismatchError, match=r"top_p=0.9 but the trainer scores with trainer.top_p=1"):
        GRPOTrainer(model, GRPOConfig()).step(batch)
    assert param_digest(model) == before  # refused before any update
    greedy = _varied_batch(tiny, metadata={3: {"sampling": {"temperature": 0.0, "top_p": 0.9}}})
    GRPOTrainer(model, GRPOConfig(), on_policy=False).compute_gradients(greedy)  # greedy: no nucleus


def test_gym_results_record_how_they_were_sampled(tiny: TinyVLM) -> None:
    item = {
        "type": "message",
        "role": "assistant",
        "id": "m",
        "status": "completed",
        "content": [{"type": "output_text", "text": "ok", "annotations": []}],
        "prompt_token_ids": [1, 2, 3],
        "generation_token_ids": [4, 5],
        "generation_log_probs": [-1.0, -2.0],
    }
    base = {"responses_create_params": {"input": "hi", "temperature": 0.8}, "reward": 1.0}
    echoed = from_gym_result({**base, "response": {"output": [item], "top_p": 0.7, "temperature": None}})
    assert echoed.metadata["sampling"] == {"temperature": 0.8, "top_p": 0.7}
    default = from_gym_result({**base, "response": {"output": [item]}})
    assert default.metadata["sampling"] == {"temperature": 0.8, "top_p": 1.0}  # the server's default
    bare = from_gym_result({"reward": 1.0, "response": {"output": [item]}})
    assert "sampling" not in bare.metadata


# ------------------------------------------------------------------ KL


def test_kl_reference_is_frozen_and_kl_is_reported(tiny: TinyVLM) -> None:
    model = tiny_policy(0)
    fixed = with_current_logprobs(model, _varied_batch(tiny))
    trainer = GRPOTrainer(model, GRPOConfig(lr=1e-2, kl_coef=0.1), on_policy=False)
    assert trainer.reference is not None and trainer.reference is not model
    assert not any(p.requires_grad for p in trainer.reference.parameters())
    ref_digest, start = param_digest(trainer.reference), param_digest(model)
    assert ref_digest == start
    metrics = [trainer.step(fixed) for _ in range(3)]
    assert param_digest(trainer.reference) == ref_digest  # never updated
    assert param_digest(model) != start
    assert metrics[0].kl == pytest.approx(0.0, abs=1e-7)  # policy == reference before the first update
    assert metrics[1].kl > 1e-6 and metrics[2].kl > metrics[1].kl


def test_kl_coef_zero_builds_no_reference(tiny: TinyVLM) -> None:
    trainer = GRPOTrainer(tiny_policy(0), GRPOConfig())
    assert trainer.reference is None
    with pytest.raises(ValueError, match="kl_coef is 0"):
        trainer.freeze_reference()


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_estimators_are_schulmans(estimator: str) -> None:
    new = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, -0.5]])
    r = ref - new
    want = -r if estimator == "k1" else torch.exp(r) - r - 1
    torch.testing.assert_close(kl_estimate(new, ref, estimator), want)  # type: ignore[arg-type]
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    zero = torch.zeros(1)
    _, stats = grpo_token_loss(
        new,
        new,
        zero,
        mask,
        ref_logprobs=ref,
        kl_coef=0.0,
        kl_estimator=estimator,  # type: ignore[arg-type]
    )
    assert stats["ref_kl_sum"] == pytest.approx(float(want[0, :2].sum()))


def test_low_var_kl_clamps_k3_at_10_and_bias_correction_weighs_the_term_by_the_ratio() -> None:
    """Both options on a step: low_var_kl's value stops at 10 (tokens with ``ref - new > 2.61``), and
    the bias-corrected term is ``exp(new - old) * k3`` (docs/grpo.md; tests/peers: verl's and TRL's)."""
    new = torch.tensor([[-1.0, -4.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.5, -4.0, -0.2]])
    ref = torch.tensor([[-1.2, -0.5, -0.5]])  # r = ref - new: -0.2, 3.5 (k3 = 29.6), 0.0
    mask = torch.ones(1, 3)
    k3 = kl_estimate(new.detach(), ref, "k3")
    assert float(k3[0, 1]) > 10
    low = kl_estimate(new.detach(), ref, "low_var_kl")
    assert low[0].tolist() == pytest.approx([float(k3[0, 0]), 10.0, 0.0])

    def kl_loss(**kwargs: Any) -> float:
        loss, _ = grpo_token_loss(new, old, torch.zeros(1), mask, ref_logprobs=ref, kl_coef=1.0, **kwargs)
        return float(loss.detach())

    ratio = torch.exp(new.detach() - old)
    assert kl_loss() == pytest.approx(float(k3.mean()))
    assert kl_loss(kl_estimator="low_var_kl") == pytest.approx(float(low.mean()))
    assert kl_loss(kl_bias_correction=True) == pytest.approx(float((ratio * k3).mean()))


def test_the_objective_options_are_run_config_settings() -> None:
    """``--set trainer.clip_ratio_c=3`` and friends reach the trainer's config; bad values are refused."""
    from gymbridge.errors import ConfigError
    from gymbridge.run import load_run_config

    sets = [
        ("trainer.clip_ratio_c", 3.0),
        ("trainer.kl_estimator", "low_var_kl"),
        ("trainer.kl_bias_correction", True),
    ]
    cfg = load_run_config([], sets)
    assert (cfg.trainer.clip_ratio_c, cfg.trainer.kl_estimator, cfg.trainer.kl_bias_correction) == (
        3.0,
        "low_var_kl",
        True,
    )
    assert (GRPOConfig().clip_ratio_c, GRPOConfig().kl_bias_correction) == (None, False)  # off by default
    with pytest.raises(ConfigError, match="clip_ratio_c"):
        load_run_config([], [("trainer.clip_ratio_c", 1.0)])


def test_lr_schedule_is_one_update_ahead_of_transformers_zero_indexed_scheduler() -> None:
    """Update ``k`` runs at ``lr_at(k)``; transformers' ``LambdaLR`` runs update ``k`` at its step
    ``k - 1`` (the first at lr 0), so ours is theirs one update later (docs/grpo.md)."""
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

    cfg = GRPOConfig(lr=2e-3, lr_warmup_steps=10, lr_schedule="cosine", lr_decay_steps=40, lr_min_ratio=0.1)
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=cfg.lr)
    sched = get_cosine_with_min_lr_schedule_with_warmup(opt, 10, 40, min_lr_rate=0.1)
    theirs = []
    for _ in range(41):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert theirs[0] == 0.0
    assert [cfg.lr_at(k) for k in range(1, 41)] == pytest.approx(theirs[1:], rel=1e-12)


def test_the_kl_term_pulls_a_drifted_policy_back_to_the_reference(tiny: TinyVLM) -> None:
    model = tiny_policy(0)
    batch = _varied_batch(tiny)
    trainer = GRPOTrainer(model, GRPOConfig(lr=3e-3, kl_coef=1.0), on_policy=False)
    with torch.no_grad():  # drift away from the reference
        gen = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    no_signal = replace(with_current_logprobs(model, batch), advantages=torch.zeros(len(batch)))
    kls = [trainer.step(no_signal).kl for _ in range(4)]
    assert kls[0] > 1e-3
    assert kls[-1] < 0.7 * kls[0], kls


def test_a_checkpoint_keeps_the_reference_not_the_policy(tiny: TinyVLM, tmp_path: Any) -> None:
    model = tiny_policy(0)
    trainer = GRPOTrainer(model, GRPOConfig(lr=1e-2, kl_coef=0.1), on_policy=False)
    trainer.step(with_current_logprobs(model, _varied_batch(tiny)))
    assert trainer.reference is not None
    ref_digest = param_digest(trainer.reference)
    save_checkpoint(tmp_path, step=1, policy_version=1, trainer=trainer, done_task_indices=[0, 1])
    fresh = GRPOTrainer(tiny_policy(1), GRPOConfig(lr=1e-2, kl_coef=0.1))
    load_checkpoint(tmp_path, trainer=fresh)
    assert fresh.reference is not None
    assert param_digest(fresh.reference) == ref_digest != param_digest(fresh.model)
    plain = GRPOTrainer(tiny_policy(0), GRPOConfig())
    save_checkpoint(tmp_path / "plain", step=1, policy_version=1, trainer=plain, done_task_indices=[])
    with pytest.raises(CheckpointError, match="no reference policy"):
        load_checkpoint(tmp_path / "plain", trainer=GRPOTrainer(tiny_policy(0), GRPOConfig(kl_coef=0.1)))


# ------------------------------------------------------------------ loss aggregation


def _direct_loss(model: torch.nn.Module, batch: TrainBatch, mode: LossAgg, eps: float = 0.2) -> torch.Tensor:
    """The batch loss written out on the whole batch, without the trainer."""
    new = token_logprobs(model, batch)
    m = batch.loss_mask
    ratio = torch.exp((new - batch.logprobs) * m)
    adv = batch.advantages[:, None]
    per = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + eps) * adv) * m
    rows = float((m.sum(1) > 0).sum())
    if mode == "token_mean":
        return per.sum() / m.sum()
    if mode == "seq_mean_token_sum":
        return per.sum(1).sum() / rows
    return (per.sum(1) / m.sum(1).clamp(min=1)).sum() / rows


@pytest.mark.parametrize("mode", MODES)
def test_each_loss_agg_mode_equals_a_direct_full_batch_computation(tiny: TinyVLM, mode: LossAgg) -> None:
    model = tiny_policy(0)
    batch = _off_policy(model, _varied_batch(tiny))
    params = [p for p in model.parameters() if p.requires_grad]
    want = torch.autograd.grad(_direct_loss(model, batch, mode), params, allow_unused=True)
    cfg = GRPOConfig(loss_agg=mode)
    whole = GRPOTrainer(model, cfg).compute_gradients(batch)
    micro = GRPOTrainer(model, cfg.model_copy(update={"micro_batch_max_tokens": 40})).compute_gradients(batch)
    assert len(batch.micro_batches(40)) > 2
    for w, g, mg in zip(want, whole.grads, micro.grads, strict=True):
        ref = torch.zeros_like(g) if w is None else w
        torch.testing.assert_close(g, ref, atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(mg, ref, atol=1e-6, rtol=1e-4)
    # DP shards with the whole batch's normalisers sum to it too
    tokens, rows = int(batch.loss_mask.sum()), int((batch.loss_mask.sum(1) > 0).sum())
    parts = [
        GRPOTrainer(model, cfg).compute_gradients(s, total_loss_tokens=tokens, total_loss_rows=rows)
        for s in batch.shard(3, group_aware=False)
    ]
    for i, g in enumerate(whole.grads):
        torch.testing.assert_close(sum(p.grads[i] for p in parts), g, atol=1e-6, rtol=1e-4)
    assert sum(p.loss_sum for p in parts) == pytest.approx(whole.loss_sum, abs=1e-6)


def test_the_loss_agg_modes_weigh_rows_differently(tiny: TinyVLM) -> None:
    model = tiny_policy(0)
    batch = _off_policy(model, _varied_batch(tiny))
    losses = {m: GRPOTrainer(model, GRPOConfig(loss_agg=m)).compute_gradients(batch).loss_sum for m in MODES}
    assert len({round(v, 6) for v in losses.values()}) == 3, losses


# ------------------------------------------------------------------ overlong masking


def test_mask_truncated_masks_rows_that_hit_the_token_limit_before_the_split(tiny: TinyVLM) -> None:
    model = tiny_policy(0)
    hit = {"incomplete_reason": "max_output_tokens"}
    raw = _varied_batch(tiny, metadata={1: hit, 6: hit, 2: {"incomplete_reason": "content_filter"}})
    batch = _off_policy(model, raw)
    cfg = GRPOConfig(mask_truncated=True, micro_batch_max_tokens=60)
    trainer = GRPOTrainer(model, cfg, on_policy=False)
    prepared, masked = trainer.prepare(batch)
    assert masked == 2
    assert prepared.loss_mask[[1, 6]].sum() == 0 and torch.equal(prepared.loss_mask[0], batch.loss_mask[0])
    assert prepared.loss_mask[2].sum() > 0  # only the token limit counts
    by_hand = batch.loss_mask.clone()
    by_hand[[1, 6]] = 0
    want = GRPOTrainer(model, GRPOConfig(micro_batch_max_tokens=60)).compute_gradients(
        replace(batch, loss_mask=by_hand)
    )
    got = trainer.compute_gradients(prepared)
    for g, w in zip(got.grads, want.grads, strict=True):
        torch.testing.assert_close(g, w, atol=1e-7, rtol=1e-5)
    metrics = GRPOTrainer(tiny_policy(0), cfg, on_policy=False).step(batch)
    assert metrics.truncated_masked == 2 and metrics.num_loss_tokens == int(by_hand.sum())
    off = GRPOTrainer(tiny_policy(0), GRPOConfig(), on_policy=False).step(batch)
    assert off.truncated_masked == 0 and off.num_loss_tokens == int(batch.loss_mask.sum())


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), top_p=st.floats(0.05, 0.999), scale=st.floats(0.1, 8.0))
def test_nucleus_logprobs_equal_transformers_top_p_warper(seed: int, top_p: float, scale: float) -> None:
    """The trainer's nucleus is the generator's: TopPLogitsWarper's renormalised logprobs, token by token."""
    from transformers.generation.logits_process import TopPLogitsWarper

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 50, generator=gen) * scale
    logits[:, :3] = float("-inf")  # suppressed ids, as the media mask leaves them
    warped = torch.log_softmax(TopPLogitsWarper(top_p)(None, logits), dim=-1)
    targets = torch.multinomial(warped.exp(), 1, generator=gen)[:, 0]  # sampled: inside the nucleus
    got, outside = nucleus_logprobs(logits, targets, top_p)
    torch.testing.assert_close(got, warped.gather(-1, targets[:, None])[:, 0], atol=1e-6, rtol=1e-6)
    assert not outside.any()


def test_regression_trainer_temperature_below_float32_range_is_refused_not_nan(tiny: TinyVLM) -> None:
    """``trainer.temperature = 1e-40`` divided the logits into inf: the step's loss was NaN. Rows
    sampled at such a temperature were greedy (no nucleus), so their top_p is not compared."""
    model = tiny_policy(0)
    batch = _varied_batch(tiny)
    before = param_digest(model)
    for temperature in (1e-40, 1e-300):
        with pytest.raises(ValueError, match="greedy"):
            token_logprobs(model, batch, temperature=temperature)
    assert param_digest(model) == before
    tiny_greedy = _varied_batch(tiny, metadata={3: {"sampling": {"temperature": 1e-40, "top_p": 0.9}}})
    GRPOTrainer(model, GRPOConfig(), on_policy=False).compute_gradients(tiny_greedy)


# ------------------------------------------------------------------ entropy bonus


def test_entropy_is_the_categorical_entropy_and_suppressed_tokens_add_no_nan() -> None:
    from gymbridge.trainer.objective import entropy_of as _entropy

    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0), requires_grad=True)
    want = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(_entropy(logits), want)
    masked = logits.index_fill(-1, torch.tensor([2, 7]), float("-inf"))
    ent = _entropy(masked)
    keep = [i for i in range(11) if i not in (2, 7)]
    torch.testing.assert_close(ent, torch.distributions.Categorical(logits=logits[:, keep]).entropy())
    (grad,) = torch.autograd.grad(ent.sum(), logits)
    assert bool(torch.isfinite(grad).all()) and bool((grad[:, [2, 7]] == 0).all())


def test_entropy_bonus_is_in_the_loss_its_gradient_and_the_step_metrics(tiny: TinyVLM) -> None:
    """``entropy_coef`` subtracts ``coef * H_t`` per loss token: the gradient is the plain loss's
    minus the coefficient times that of the masked token-mean entropy, micro-batches and DP shards
    still sum to it, and ``StepMetrics.entropy`` reports it (``None`` with the bonus off)."""
    from gymbridge.trainer.forward import scored_logprobs as _token_logprobs

    model = tiny_policy(0)
    batch = _off_policy(model, _varied_batch(tiny))
    params = [p for p in model.parameters() if p.requires_grad]
    coef = 0.3
    plain = GRPOTrainer(model, GRPOConfig()).compute_gradients(batch)
    assert plain.entropy_sum is None
    _, _, ent = _token_logprobs(
        model, batch, temperature=1.0, suppress_token_ids=None, top_p=1.0, entropy=True
    )
    assert ent is not None
    mask = batch.loss_mask
    mean_ent = (ent * mask).sum() / mask.sum()
    ent_grads = torch.autograd.grad(mean_ent, params, allow_unused=True)
    mean_ent = mean_ent.detach()
    cfg = GRPOConfig(entropy_coef=coef)
    with_bonus = GRPOTrainer(model, cfg).compute_gradients(batch)
    assert with_bonus.entropy_sum == pytest.approx(float((ent.detach() * mask).sum()), rel=1e-5)
    assert with_bonus.loss_sum == pytest.approx(plain.loss_sum - coef * float(mean_ent), abs=1e-5)
    for g, g0, ge in zip(with_bonus.grads, plain.grads, ent_grads, strict=True):
        want = g0 - coef * (torch.zeros_like(g0) if ge is None else ge)
        torch.testing.assert_close(g, want, atol=1e-6, rtol=1e-4)
    micro = GRPOTrainer(model, cfg.model_copy(update={"micro_batch_max_tokens": 40})).compute_gradients(batch)
    tokens, rows = int(mask.sum()), int((mask.sum(1) > 0).sum())
    parts = [
        GRPOTrainer(model, cfg).compute_gradients(s, total_loss_tokens=tokens, total_loss_rows=rows)
        for s in batch.shard(3, group_aware=False)
    ]
    for i, g in enumerate(with_bonus.grads):
        torch.testing.assert_close(micro.grads[i], g, atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(sum(p.grads[i] for p in parts), g, atol=1e-6, rtol=1e-4)
    # the step reports the token-mean entropy; with the bonus off it is not computed
    fixed = with_current_logprobs(model, batch)
    on = GRPOTrainer(tiny_policy(0), cfg).step(fixed)
    assert on.entropy == pytest.approx(float(mean_ent), rel=1e-4)
    assert GRPOTrainer(tiny_policy(0), GRPOConfig()).step(fixed).entropy is None


def test_entropy_bonus_trains_a_zero_advantage_batch_and_raises_the_entropy(tiny: TinyVLM) -> None:
    """Without a KL or entropy term a batch whose advantages are all 0 is skipped (no signal); with
    the bonus it steps, and the steps raise the policy's entropy at the answer tokens."""
    model = tiny_policy(0)
    batch = with_current_logprobs(model, _varied_batch(tiny))
    no_signal = replace(batch, advantages=torch.zeros(len(batch)))
    assert GRPOTrainer(tiny_policy(0), GRPOConfig()).step(no_signal).skipped == "zero_advantage"
    trainer = GRPOTrainer(model, GRPOConfig(lr=3e-3, entropy_coef=1.0), on_policy=False)
    entropies = []
    for _ in range(4):
        m = trainer.step(with_current_logprobs(model, no_signal))
        assert m.skipped is None and m.entropy is not None
        entropies.append(m.entropy)
    assert entropies[-1] > entropies[0] + 1e-3, entropies


def test_entropy_coef_is_a_run_config_setting() -> None:
    from gymbridge.errors import ConfigError
    from gymbridge.run import load_run_config

    assert load_run_config([], [("trainer.entropy_coef", 0.01)]).trainer.entropy_coef == 0.01
    assert GRPOConfig().entropy_coef == 0.0
    with pytest.raises(ConfigError, match="entropy_coef"):
        load_run_config([], [("trainer.entropy_coef", -0.1)])
