"""gymbridge's objective against verl's and TRL's own functions, case by case (docs/grpo.md).

Each case runs once through the peer's installed function (``peer_objective.py`` in
``.venv-verl``) and once through gymbridge's (:func:`~gymbridge.trainer.grpo.grpo_token_loss`,
:func:`~gymbridge.trainer.grpo.kl_estimate`, :func:`~gymbridge.tensors.batch.group_advantages`,
``GRPOConfig.lr_at``), in float64: the loss and its gradient with respect to the new logprobs
must agree where the docs say the two agree, and differ exactly as the docs say where they do
not (a row without loss tokens in TRL's ``grpo`` mean, a group of one, the lr schedule's index).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from _peers import run_peers

from gymbridge.tensors.batch import group_advantages
from gymbridge.trainer.grpo import GRPOConfig, LossAgg, grpo_token_loss, kl_estimate

pytestmark = pytest.mark.timeout(1200)

ROWS, LENGTH = 6, 5
VERL_MODES: dict[LossAgg, str] = {
    "token_mean": "token-mean",
    "seq_mean_token_sum": "seq-mean-token-sum",
    "seq_mean_token_mean": "seq-mean-token-mean",
}
DUAL_CLIPS = (1.5, 3.0)
KL_PENALTIES = {"k1": "kl", "low_var_kl": "low_var_kl"}
BETA = 0.04


def _batch(seed: int, *, on_policy: bool = False) -> dict[str, torch.Tensor]:
    """Logprobs ``[ROWS, LENGTH]`` whose ratios reach past 3 both ways; row 2 holds no loss token."""
    gen = torch.Generator().manual_seed(seed)
    new = -torch.rand(ROWS, LENGTH, generator=gen, dtype=torch.float64) * 3
    old = new if on_policy else new - torch.randn(ROWS, LENGTH, generator=gen, dtype=torch.float64) * 1.2
    ref = new + torch.randn(ROWS, LENGTH, generator=gen, dtype=torch.float64) * 0.8
    mask = (torch.rand(ROWS, LENGTH, generator=gen) < 0.8).to(torch.float64)
    mask[:, 0] = 1.0
    mask[2] = 0.0
    adv = torch.tensor([1.2, -0.7, 0.5, -1.9, 0.3, -0.4], dtype=torch.float64)
    return {"new": new, "old": old, "ref": ref, "mask": mask, "advantages": adv}


def _json(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {k: v.tolist() for k, v in batch.items()}


def _ours(batch: dict[str, torch.Tensor], **kwargs: Any) -> tuple[float, torch.Tensor, dict[str, float]]:
    new = batch["new"].clone().requires_grad_(True)
    loss, stats = grpo_token_loss(
        new, batch["old"], batch["advantages"], batch["mask"], clip_eps_low=0.2, clip_eps_high=0.28, **kwargs
    )
    (grad,) = torch.autograd.grad(loss, new)
    return float(loss.detach()), grad, stats


def _close(ours: float | torch.Tensor, theirs: Any) -> None:
    torch.testing.assert_close(
        torch.as_tensor(ours, dtype=torch.float64),
        torch.as_tensor(theirs, dtype=torch.float64),
        atol=1e-9,
        rtol=1e-7,
    )


def _cases() -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    for mode, verl_mode in VERL_MODES.items():
        for c in DUAL_CLIPS:
            cases.append(
                {
                    "kind": "verl_policy_loss",
                    "id": f"{mode}-{c}",
                    **_json(_batch(0)),
                    "clip_low": 0.2,
                    "clip_high": 0.28,
                    "clip_ratio_c": c,
                    "loss_agg_mode": verl_mode,
                }
            )
    grid = torch.linspace(-15.0, 6.0, 43, dtype=torch.float64)[None, :]  # r = ref - new
    new = torch.full_like(grid, -2.0)
    for ours, theirs in KL_PENALTIES.items():
        cases.append(
            {
                "kind": "verl_kl",
                "id": ours,
                "new": new.tolist(),
                "ref": (new + grid).tolist(),
                "kl_penalty": theirs,
            }
        )
    for on_policy in (False, True):
        for correction in (False, True):
            cases.append(
                {
                    "kind": "trl_loss",
                    "id": f"kl-{on_policy}-{correction}",
                    **_json(_batch(1, on_policy=on_policy)),
                    "beta": BETA,
                    "use_bias_correction_kl": correction,
                    "delta": None,
                    "loss_type": "dapo",
                    "epsilon_low": 0.2,
                    "epsilon_high": 0.28,
                }
            )
    trl_plain = {"beta": 0.0, "use_bias_correction_kl": False, "epsilon_low": 0.2, "epsilon_high": 0.28}
    cases.append(
        {
            "kind": "trl_loss",
            "id": "delta",
            **_json(_batch(2)),
            **trl_plain,
            "delta": 3.0,
            "loss_type": "dapo",
        }
    )
    for loss_type in ("grpo", "bnpo"):
        cases.append(
            {
                "kind": "trl_loss",
                "id": loss_type,
                **_json(_batch(3)),
                **trl_plain,
                "delta": None,
                "loss_type": loss_type,
            }
        )
    cases.append(
        {
            "kind": "verl_grpo_advantage",
            "id": "groups",
            "rewards": [1.0, 0.0, 1.0, 1.0, 0.7],
            "index": ["a", "a", "a", "a", "b"],
            "norm_by_std": True,
        }
    )
    for zero_indexed in (True, False):
        cases.append(
            {
                "kind": "verl_lr",
                "id": f"lr-{zero_indexed}",
                "lr": 2e-3,
                "warmup": 10,
                "total": 40,
                "min_lr_ratio": 0.1,
                "zero_indexed_step": zero_indexed,
                "updates": 45,
            }
        )
    return cases


@pytest.fixture(scope="module")
def peers(verl_python: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """Every case's result from verl / TRL, by ``(kind, id)``: one subprocess for the module."""
    cases = _cases()
    results = run_peers(verl_python, cases)
    return {(c["kind"], c["id"]): r for c, r in zip(cases, results, strict=True)}


@pytest.mark.parametrize("mode", list(VERL_MODES))
@pytest.mark.parametrize("c", DUAL_CLIPS)
def test_dual_clip_equals_verls_policy_loss(
    peers: dict[tuple[str, str], Any], mode: LossAgg, c: float
) -> None:
    theirs = peers[("verl_policy_loss", f"{mode}-{c}")]
    loss, grad, stats = _ours(_batch(0), clip_ratio_c=c, loss_agg=mode)
    _close(loss, theirs["loss"])
    _close(grad, theirs["grad"])
    assert stats["dual_clipped"] > 0 and theirs["clipfrac_lower"] > 0  # the case reaches the dual clip
    plain, _, _ = _ours(_batch(0), loss_agg=mode)
    assert abs(plain - theirs["loss"]) > 1e-3  # without it, verl's default loss is another one


@pytest.mark.parametrize("estimator", list(KL_PENALTIES))
def test_kl_estimators_equal_verls_kl_penalty(peers: dict[tuple[str, str], Any], estimator: str) -> None:
    theirs = peers[("verl_kl", estimator)]
    new = torch.full((1, 43), -2.0, dtype=torch.float64, requires_grad=True)
    r = torch.linspace(-15.0, 6.0, 43, dtype=torch.float64)[None, :]
    kl = kl_estimate(new, new.detach() + r, estimator)  # type: ignore[arg-type]
    (grad,) = torch.autograd.grad(kl.sum(), new)
    _close(kl.detach(), theirs["kl"])
    _close(grad, theirs["grad"])


def test_low_var_kl_changes_exactly_the_tokens_whose_k3_passes_10() -> None:
    """k3 >= 0, so the clamp to [-10, 10] acts where ``r = ref - new > 2.61`` or ``r < -11.0``."""
    new = torch.zeros(1, 2001, dtype=torch.float64)
    r = torch.linspace(-15.0, 6.0, 2001, dtype=torch.float64)[None, :]
    k3 = kl_estimate(new, r, "k3")
    low_var = kl_estimate(new, r, "low_var_kl")
    changed = (k3 != low_var)[0]
    assert torch.equal(changed, (k3 > 10.0)[0])
    assert torch.equal(changed, ((r > 2.6109) | (r < -10.99998))[0])
    assert float(low_var.max()) == 10.0


@pytest.mark.parametrize("on_policy", [False, True])
@pytest.mark.parametrize("correction", [False, True])
def test_kl_bias_correction_equals_trls(
    peers: dict[tuple[str, str], Any], on_policy: bool, correction: bool
) -> None:
    """TRL's ``dapo`` loss (a token mean over the batch) with ``beta`` and ``use_bias_correction_kl``."""
    theirs = peers[("trl_loss", f"kl-{on_policy}-{correction}")]
    batch = _batch(1, on_policy=on_policy)
    kwargs = {"ref_logprobs": batch["ref"], "kl_coef": BETA, "kl_estimator": "k3"}
    loss, grad, _ = _ours(batch, kl_bias_correction=correction, **kwargs)
    _close(loss, theirs["loss"])
    _close(grad, theirs["grad"])
    other_loss, other_grad, _ = _ours(batch, kl_bias_correction=not correction, **kwargs)
    assert (grad - other_grad).abs().max() > 1e-4  # the correction moves the gradient, on-policy too
    if on_policy:
        _close(loss, other_loss)  # ... but not the value there: the ratio is 1


def test_dual_clip_equals_trls_delta(peers: dict[tuple[str, str], Any]) -> None:
    """TRL's two-sided ``delta`` (>= 1 + epsilon_high) gives the dual clip's loss and gradient."""
    theirs = peers[("trl_loss", "delta")]
    loss, grad, stats = _ours(_batch(2), clip_ratio_c=3.0)
    assert stats["dual_clipped"] > 0
    _close(loss, theirs["loss"])
    _close(grad, theirs["grad"])


def test_loss_denominators_when_a_row_carries_no_loss_token(peers: dict[tuple[str, str], Any]) -> None:
    """Row 2 has no loss token: gymbridge's row means divide by the rows that have one (as verl's
    ``agg_loss`` without a global size), TRL's ``grpo`` mean divides by every row."""
    batch = _batch(3)
    rows_with_tokens = int((batch["mask"].sum(1) > 0).sum())
    assert rows_with_tokens == ROWS - 1
    seq_mean, seq_grad, _ = _ours(batch, loss_agg="seq_mean_token_mean")
    theirs = peers[("trl_loss", "grpo")]
    _close(seq_mean * rows_with_tokens / ROWS, theirs["loss"])
    _close(seq_grad * rows_with_tokens / ROWS, theirs["grad"])
    token_mean, token_grad, _ = _ours(batch, loss_agg="token_mean")
    _close(token_mean, peers[("trl_loss", "bnpo")]["loss"])
    _close(token_grad, peers[("trl_loss", "bnpo")]["grad"])


def test_a_group_of_one_gets_advantage_0_here_and_its_reward_in_verl(
    peers: dict[tuple[str, str], Any],
) -> None:
    theirs = peers[("verl_grpo_advantage", "groups")]["advantages"]
    ours = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 4).tolist()
    _close(torch.tensor(ours), theirs[:4])  # a real group: the same (r - mean) / (std + 1e-6)
    assert group_advantages(torch.tensor([0.7]), 1).tolist() == [0.0]
    assert theirs[4] == pytest.approx(0.7, rel=1e-5)  # verl: mean 0, std 1 for a group of one


def test_lr_schedule_is_one_update_ahead_of_verls_zero_indexed_one(peers: dict[tuple[str, str], Any]) -> None:
    cfg = GRPOConfig(lr=2e-3, lr_warmup_steps=10, lr_schedule="cosine", lr_decay_steps=40, lr_min_ratio=0.1)
    zero = peers[("verl_lr", "lr-True")]["lr"]  # zero[u - 1]: verl's lr at update u
    one = peers[("verl_lr", "lr-False")]["lr"]
    assert zero[0] == 0.0  # verl's first update (0-indexed step 0) does not move the weights
    for u in range(1, 41):
        assert cfg.lr_at(u) == pytest.approx(zero[u], rel=1e-12), u  # ours = verl's next update
        assert cfg.lr_at(u) == pytest.approx(one[u - 1], rel=1e-12), u  # = verl's zero_indexed_step=False
    # past lr_decay_steps verl's cosine rises again from the floor; gymbridge's stays there
    assert one[44] > 1.1 * cfg.lr_min_ratio * cfg.lr
    assert cfg.lr_at(45) == pytest.approx(cfg.lr_min_ratio * cfg.lr)
    assert math.isclose(max(one), cfg.lr)
