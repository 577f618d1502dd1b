"""The reference GRPO step on the tiny VLM: it trains, masks, clips and reports honestly."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from trainer_helpers import make_batch, with_current_logprobs

from gymbridge.errors import TrajectoryError
from gymbridge.models.tiny_vlm import TinyVLM
from gymbridge.tensors import TrainBatch
from gymbridge.trainer import GRPOConfig, GRPOTrainer, grpo_token_loss, tiny_policy, token_logprobs


@pytest.fixture(scope="module")
def batch(tiny: TinyVLM) -> TrainBatch:
    return make_batch(tiny)


def _row_mean(lp: torch.Tensor, batch: TrainBatch, positive: bool) -> float:
    rows = batch.advantages > 0 if positive else batch.advantages < 0
    mask = rows[:, None] & (batch.loss_mask > 0)
    return float(lp[mask].mean())


def test_repeated_steps_raise_positive_advantage_logprobs(tiny: TinyVLM, batch: TrainBatch) -> None:
    model = tiny_policy(0)
    fixed = with_current_logprobs(model, batch)
    # several epochs on one batch: off-policy after the first, on purpose
    trainer = GRPOTrainer(model, GRPOConfig(lr=3e-3, clip_eps_high=10.0, clip_eps_low=0.9), on_policy=False)
    before = token_logprobs(model, fixed).detach()
    metrics = [trainer.step(fixed) for _ in range(6)]
    with torch.no_grad():
        after = token_logprobs(model, fixed)
    gain_pos = _row_mean(after, fixed, True) - _row_mean(before, fixed, True)
    gain_neg = _row_mean(after, fixed, False) - _row_mean(before, fixed, False)
    assert gain_pos > 0.2, (gain_pos, gain_neg)
    assert gain_neg < gain_pos - 0.4
    assert metrics[0].mean_ratio == pytest.approx(1.0, abs=1e-5)  # logprobs reproduce: on-policy at step 0
    assert abs(metrics[0].loss) < 1e-5  # group-normalised advantages sum to zero at ratio 1
    assert metrics[-1].loss < metrics[0].loss
    assert all(m.num_loss_tokens == int(fixed.loss_mask.sum()) == 32 for m in metrics)
    assert metrics[0].mean_reward == pytest.approx(0.5)
    assert metrics[0].grad_norm > 0


def test_untrained_tokens_do_not_move_the_loss(tiny: TinyVLM, batch: TrainBatch) -> None:
    """Prompt / image / padding positions are outside the loss: their stored logprobs are irrelevant."""
    model = tiny_policy(0)
    fixed = with_current_logprobs(model, batch)
    noisy = replace(fixed, logprobs=fixed.logprobs + (1 - fixed.loss_mask) * 5.0)
    a = GRPOTrainer(model, GRPOConfig()).compute_gradients(fixed)
    b = GRPOTrainer(model, GRPOConfig()).compute_gradients(noisy)
    assert a.loss_sum == pytest.approx(b.loss_sum, abs=1e-7)
    assert all(torch.equal(x, y) for x, y in zip(a.grads, b.grads, strict=True))


def test_micro_batches_sum_to_the_full_batch_gradient(tiny: TinyVLM, batch: TrainBatch) -> None:
    model = tiny_policy(0)
    fixed = with_current_logprobs(model, batch)
    whole = GRPOTrainer(model, GRPOConfig(micro_batch_max_tokens=10_000)).compute_gradients(fixed)
    split = GRPOTrainer(model, GRPOConfig(micro_batch_max_tokens=40)).compute_gradients(fixed)
    for x, y in zip(whole.grads, split.grads, strict=True):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-4)


def test_teacher_forced_logprobs_match_a_single_row_forward(tiny: TinyVLM, batch: TrainBatch) -> None:
    """Batching rows with right padding and their images together gives each row's own logprobs."""
    model = tiny_policy(0)
    with torch.no_grad():
        together = token_logprobs(model, batch)
        for i in (0, 5):
            alone = token_logprobs(model, batch.select([i]).trim())
            n = alone.shape[1]
            torch.testing.assert_close(together[i, :n], alone[0], atol=1e-5, rtol=1e-5)


def test_clipped_loss_stops_pushing_past_the_trust_region() -> None:
    old = torch.zeros(2, 3)
    new = torch.tensor([[0.0, 0.5, -0.5], [0.0, 0.5, -0.5]], requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    loss, stats = grpo_token_loss(new, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2)
    (grad,) = torch.autograd.grad(loss, new)
    # A > 0, ratio e^0.5 > 1.2: clipped, no gradient; A > 0, ratio e^-0.5: unclipped, pushed up
    assert grad[0, 1] == 0 and grad[0, 2] < 0
    # A < 0, ratio e^0.5: unclipped, pushed down; A < 0, ratio e^-0.5 < 0.8: clipped, no gradient
    assert grad[1, 1] > 0 and grad[1, 2] == 0
    assert grad[:, 0].abs().sum() == 0  # masked prompt token
    assert stats["clipped"] == 2


def test_empty_loss_mask_is_a_no_op_step(tiny: TinyVLM, batch: TrainBatch) -> None:
    model = tiny_policy(0)
    masked = replace(batch, loss_mask=torch.zeros_like(batch.loss_mask))
    res = GRPOTrainer(model, GRPOConfig()).compute_gradients(masked)
    assert res.loss_tokens == 0 and all(float(g.abs().sum()) == 0 for g in res.grads)


def test_regression_generated_placeholder_is_a_clear_error_not_a_vlm_crash(
    tiny: TinyVLM, batch: TrainBatch
) -> None:
    """A sampled ``<|image_pad|>`` used to surface as transformers' "Image features and image tokens
    do not match"; the trainer now names the problem and the rows."""
    ids = batch.input_ids.clone()
    ids[2, int(batch.lengths[2]) - 2] = tiny.image_token_id
    with pytest.raises(TrajectoryError, match=r"33 image placeholder tokens but its images give 32"):
        token_logprobs(tiny_policy(0), replace(batch, input_ids=ids))


def test_a_stray_video_placeholder_without_videos_is_plain_text(tiny: TinyVLM, batch: TrainBatch) -> None:
    ids = batch.input_ids.clone()
    ids[1, int(batch.lengths[1]) - 2] = tiny.video_token_id
    with torch.no_grad():
        lp = token_logprobs(tiny_policy(0), replace(batch, input_ids=ids))
    assert bool(torch.isfinite(lp).all())


def test_new_logprobs_renormalise_without_the_tokens_the_generator_never_samples(
    tiny: TinyVLM, batch: TrainBatch
) -> None:
    """HFGenerator masks media ids to -inf; the trainer's logprobs drop the same mass (ratio stays 1)."""
    from gymbridge.generation.hf import HFGenerator
    from gymbridge.trainer.forward import forward_kwargs as _forward_kwargs

    model = tiny_policy(0)
    banned = HFGenerator(model, tiny.processor).suppressed_token_ids
    assert set(banned) == {
        tiny.image_token_id,
        tiny.video_token_id,
        tiny.vision_start_token_id,
        tiny.vision_end_token_id,
    }
    with torch.no_grad():
        masked = token_logprobs(model, batch)  # default: the model's media ids, like the generator
        explicit = token_logprobs(model, batch, suppress_token_ids=banned)
        plain = token_logprobs(model, batch, suppress_token_ids=())
        probs = torch.softmax(model(**_forward_kwargs(model, batch)).logits.float(), dim=-1)
    assert torch.equal(masked, explicit)
    assert torch.isfinite(masked).all()  # also where a prompt token *is* a placeholder
    p_banned = probs[:, :-1, list(banned)].sum(-1)
    want = plain[:, 1:] - torch.log1p(-p_banned)
    loss = batch.loss_mask[:, 1:].bool()
    assert torch.allclose(masked[:, 1:][loss], want[loss], atol=1e-5)
    assert float((masked - plain)[batch.loss_mask.bool()].abs().max()) > 1e-4  # the mask matters here


def test_regression_a_batch_without_loss_tokens_leaves_the_weights_alone(
    tiny: TinyVLM, batch: TrainBatch
) -> None:
    """Every row ``mask_sample`` (or an empty batch): the gradient is zero, but ``step`` still ran
    AdamW, whose momentum from earlier steps (and weight decay) moved the weights on a batch that
    carries no learning signal."""
    model = tiny_policy(0)
    fixed = with_current_logprobs(model, batch)
    trainer = GRPOTrainer(model, GRPOConfig(lr=3e-3, weight_decay=0.1))
    trainer.step(fixed)  # builds up Adam momentum
    before = [p.detach().clone() for p in trainer.params]
    masked = replace(fixed, loss_mask=torch.zeros_like(fixed.loss_mask))
    metrics = trainer.step(masked)
    assert all(torch.equal(a, p) for a, p in zip(before, trainer.params, strict=True))
    assert metrics.num_loss_tokens == 0 and metrics.grad_norm == 0.0
    assert trainer.steps == 1  # the skipped update is not counted


def test_is_cap_truncates_the_importance_weight_of_the_unclipped_term() -> None:
    """``is_cap = C``: a ratio-5 token with a negative advantage weighs ``C``, not 5 (V-trace rho-bar)."""
    import math

    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    adv = torch.tensor([-1.0])

    def run(cap: float | None) -> list[float]:
        new = torch.tensor([[math.log(5.0), 0.0]], requires_grad=True)
        loss, stats = grpo_token_loss(new, old, adv, mask, is_cap=cap)
        (grad,) = torch.autograd.grad(loss, new)
        return [float(loss.detach()), *grad[0].tolist(), stats["capped"]]

    assert run(None) == pytest.approx([3.0, 2.5, 0.5, 0.0])  # loss (5 + 1) / 2; gradient weight 5
    assert run(2.0) == pytest.approx([1.5, 1.0, 0.5, 1.0])  # loss (2 + 1) / 2; gradient weight 2
    assert run(10.0) == pytest.approx(run(None))  # a cap above every ratio changes nothing


def test_is_cap_below_the_clip_range_is_a_config_error() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="is_cap"):
        GRPOConfig(is_cap=1.1)
    assert GRPOConfig(is_cap=1.2).is_cap == 1.2


def test_dual_clip_stops_a_negative_advantage_tokens_loss_at_c_times_its_advantage() -> None:
    """``clip_ratio_c = c``: a ratio-5 token with ``A = -1`` costs ``c``, with no gradient; ``is_cap``
    bounds the same value but keeps the gradient; positive advantages are untouched."""
    import math

    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2)

    def run(adv: float, **kwargs: float) -> list[float]:
        new = torch.tensor([[math.log(5.0), 0.0]], requires_grad=True)
        loss, stats = grpo_token_loss(new, old, torch.tensor([adv]), mask, **kwargs)
        (grad,) = torch.autograd.grad(loss, new)
        return [float(loss.detach()), *grad[0].tolist(), stats["dual_clipped"]]

    assert run(-1.0) == pytest.approx([3.0, 2.5, 0.5, 0.0])  # (5 + 1) / 2
    assert run(-1.0, clip_ratio_c=3.0) == pytest.approx([2.0, 0.0, 0.5, 1.0])  # (3 + 1) / 2, no gradient
    assert run(-1.0, is_cap=3.0) == pytest.approx([2.0, 1.5, 0.5, 0.0])  # same value, gradient weight 3
    assert run(-1.0, clip_ratio_c=6.0) == pytest.approx(run(-1.0))  # c above every ratio: nothing changes
    assert run(1.0, clip_ratio_c=1.5) == pytest.approx(run(1.0))  # A > 0: the ratio clip already bounds it
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        run(-1.0, clip_ratio_c=1.0)


def test_dual_clip_at_or_below_1_is_a_config_error_and_the_step_reports_its_fraction(
    tiny: TinyVLM, batch: TrainBatch
) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="clip_ratio_c"):
        GRPOConfig(clip_ratio_c=1.0)
    model = tiny_policy(0)
    fixed = with_current_logprobs(model, batch)
    # old logprobs 3 nats below the policy's: every ratio is e^3 ~ 20 > c
    stale = replace(fixed, logprobs=(fixed.logprobs - 3.0) * fixed.loss_mask)
    metrics = GRPOTrainer(model, GRPOConfig(clip_ratio_c=3.0), on_policy=False).step(stale)
    negative = float((stale.advantages < 0).float() @ stale.loss_mask.sum(dim=1))
    assert metrics.dual_clip_fraction == pytest.approx(negative / metrics.num_loss_tokens)
    assert 0.0 < metrics.dual_clip_fraction < 1.0
    assert GRPOTrainer(tiny_policy(0), GRPOConfig(), on_policy=False).step(stale).dual_clip_fraction == 0.0


def test_ratio_metrics_are_one_on_policy_and_the_guard_refuses_a_stale_batch(
    tiny: TinyVLM, batch: TrainBatch
) -> None:
    """The first step on the generator's own logprobs has ratio 1; a second step on the same
    (now stale) logprobs in an on-policy run fails before the optimizer moves."""
    from gymbridge.errors import PolicyDriftError

    model = tiny_policy(0)
    fixed = with_current_logprobs(model, batch)
    trainer = GRPOTrainer(model, GRPOConfig(lr=3e-3, micro_batch_max_tokens=40))
    first = trainer.step(fixed)
    assert first.ratio_mean == pytest.approx(1.0, abs=1e-5)
    assert first.ratio_max_abs_log < 1e-4
    assert first.as_dict()["ratio_mean"] == first.ratio_mean
    before = [p.detach().clone() for p in trainer.params]
    with pytest.raises(PolicyDriftError, match="the generator's weights are not the trainer's") as info:
        trainer.step(fixed)
    assert info.value.step == 2 and abs(info.value.ratio_mean - 1.0) > 1e-2
    assert all(torch.equal(a, p) for a, p in zip(before, trainer.params, strict=True))
    assert trainer.steps == 1
    off_policy = GRPOTrainer(model, GRPOConfig(lr=3e-3), on_policy=False)
    assert abs(off_policy.step(fixed).ratio_mean - 1.0) > 1e-2  # reported, not raised


def test_step_reports_forward_backward_and_optimizer_seconds(tiny: TinyVLM, batch: TrainBatch) -> None:
    """The step's split: the forward/backward passes and the update, each inside the step's time;
    a skipped update (no loss token) spends nothing in the optimizer."""
    model = tiny_policy(0)
    trainer = GRPOTrainer(model, GRPOConfig())
    metrics = trainer.step(with_current_logprobs(model, batch))
    assert metrics.forward_backward_s > 0 and metrics.optimizer_s > 0
    # wallclock-ok: intervals nested in the step's own interval (the split's invariant), no time goal
    assert metrics.forward_backward_s + metrics.optimizer_s <= metrics.elapsed_s
    assert {"forward_backward_s", "optimizer_s"} <= metrics.as_dict().keys()
    skipped = trainer.step(replace(batch, loss_mask=torch.zeros_like(batch.loss_mask)))
    assert skipped.optimizer_s == 0.0 and skipped.forward_backward_s >= 0.0
